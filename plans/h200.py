# The study on real text as it ran on one NVIDIA H200 on 2026-11-28 (results/h200-2026-11-28): a 31M-parameter
# ModernBERT (configs/study.py) pretrained with MLM on Gutenberg books (configs/study_base.py), then from it, on
# biomedical text, the CLM detour and the MLM arm at pretraining seeds 17, 42 and 43; CKA with the seed control;
# fine-tuning on NCBI-disease, AnatEM and GAD (suites/study.py) over 3 seeds. The corpora: ../shared/data/study.
#   python demo.py plans/h200.py                  # about 10 minutes on an H200 (the 2026-11-28 run was cut in GAD)
#   python demo.py plans/h200.py plans/quick.py   # every step, tiny, on CPU
# Sizes as the run had them: its time rule scaled configs/study*.py's budgets by 0.657.
out = "out/study_h200"
general = ["../shared/data/study/general.txt.xz"]
domain = ["../shared/data/study/biomed.txt.xz"]
heldout = 1500  # biomedical texts held out for CKA; 500 of them drawn per sampling seed
val_docs = 500
tokenizer = "bpe:16384"  # trained on the general text: a general tokenizer meets the domain, as ModernBERT's does
config = ["configs/study.py"]
base_config = ["configs/study_base.py"]
base_train = []
base_tokens = 65_725_244
arm_tokens = 19_717_573
# keep_every: 8 points of the trajectory over an arm's ~660 steps
arms = {"clm": ["--objective=clm", "--keep_every=75"], "mlm": ["--objective=mlm", "--keep_every=75"]}
seeds = {"clm": [17, 42, 43], "mlm": [17, 42, 43]}  # the paper's 17 and 42, and one more: an interval with 2 df
cka_n = 500
cka_len = 512
suite = "suites/study.py"
# ELECTRA-small's GLUE recipe (Clark et al. 2020), a small model's in place of the paper's Base one; 3 epochs fit the
# call (most runs then kept their last epoch: plans/h200_sequel.py runs the paper's 10, 20 for NER)
finetune = {"seeds": [42, 43, 44], "epochs": 3, "lr": 3e-4, "batch_size": 32, "warmup_ratio": 0.1}
parallel = 0  # the six arms side by side on the GPU, as they ran, and CKA beside the fine-tuning
# What it costs: results/h200-2026-11-28 measured the base at 1.33M tokens/s on the H200, and fine-tuning at about
# 20k tokens/s a process with eight sharing the GPU
train_tokens_per_s = 1_330_000
finetune_tokens_per_s = 160_000
