# The study's fine-tuning (written by demo.py --study): eval.py --suite /tmp/study/suite.py --models ARM/final
seeds = [42, 43, 44]
tasks = [
    dict(name='ncbi_disease', task='ner', data='/work/main/.study_data/ncbi_disease', epochs=3, lr=0.0003, batch_size=32, warmup_ratio=0.1),
    dict(name='anatem', task='ner', data='/work/main/.study_data/anatem', epochs=3, lr=0.0003, batch_size=32, warmup_ratio=0.1),
    dict(name='gad', task='cls', data='/work/main/.study_data/gad', epochs=3, lr=0.0003, batch_size=32, warmup_ratio=0.1),
]
