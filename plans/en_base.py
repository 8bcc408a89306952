# The paper's English study at full size: ModernBERT-base continued on the English biomedical mixture (10B tokens of
# phase 1 + the 1B decay), the detour (seed 17) against the MLM arm (seed 17, and 42 as the CKA control), CKA on
# held-out PubMed abstracts, the 11 English tasks (suites/en_bio.py) with the paper's protocol (5 seeds).
#   python demo.py plans/en_base.py --power --spread 0.5    # what it finds and costs, before any GPU hour
#   python demo.py plans/en_base.py --slurm                 # every step a SLURM job (sbatch options below)
# The paths are placeholders for your copies (README.md, Real data); with one pretraining seed an arm the design
# gives no interval over pretraining seeds: --power says how many it needs, give them in `seeds`.
out = "out/study_en_base"
base = "checkpoints/ModernBERT-base"  # <- a local copy of answerdotai/ModernBERT-base
# English 10B: literature with clinical upsampling 80%, medical instructions 20%, tokenized with the base's tokenizer
domain = ["en/literature_clinical.jsonl", "en/instructions.jsonl"]
domain_weights = [0.8, 0.2]
domain_tokens = "11B"  # phase 1 and the decay, no window read twice
heldout_texts = "en/pubmed_heldout.jsonl"  # <- in-domain texts none of the runs train on (the paper: PubMed abstracts)
val_docs = 1000
config = ["configs/en_base.py"]
arm_tokens = 10_000_000_000
arms = {"clm": ["--objective=clm"], "mlm": ["--objective=mlm"]}
seeds = {"clm": [17], "mlm": [17, 42]}  # the paper's: both arms at 17, the MLM arm's twin at 42 for the control
cka_n = 500
cka_len = 512
suite = "suites/en_bio.py"
finetune = {}  # the suite's: the paper's protocol
sbatch = {"train": ["--nodes=1", "--gpus-per-node=4"],  # 4 GPUs a run (slurm/train.sbatch requeues itself)
          "gpu": ["--gpus-per-node=1"], "all": ["--time=24:00:00"]}
# Base, 4 x 8192 packed, compiled, CLM (MLM 250k): one H200, results/h200-2026-11-27 (call5)
train_tokens_per_s = 269_000
