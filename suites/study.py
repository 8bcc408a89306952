# The study's three tasks, in ../shared/data (licences in its README): NCBI-disease and AnatEM, NER; GAD, a sentence
# classification (does it state a gene-disease association?). plans/h200.py fine-tunes every run on them; by hand:
#   python eval.py --suite suites/study.py --models out/study_h200/clm_s17/final out/study_h200/mlm_s17/final
# Every key a task leaves out is the paper's protocol (support/suite.PROTOCOL: 10 epochs, 20 for NER, lr 5e-5,
# batch 16, the best epoch by validation macro F1); a plan's `finetune` may set any of them for every task.

seeds = [42, 43, 44, 45, 46]

DATA = "../../shared/data"  # relative to this file's folder: ../shared beside the checkout

tasks = [
    dict(name="ncbi_disease", task="ner", data=f"{DATA}/ncbi_disease"),
    dict(name="anatem", task="ner", data=f"{DATA}/anatem"),
    dict(name="gad", task="cls", data=f"{DATA}/gad"),
]
