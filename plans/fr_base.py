# The paper's French study at full size: ModernCamemBERT-base continued on the French biomedical mixture (10B tokens of
# phase 1 + the 1B decay), the detour (seed 17) against the MLM arm (seed 17, and 42 as the CKA control), CKA on
# held-out clinical texts, the 8 French tasks (suites/fr_bio.py) over its 9 seeds.
#   python demo.py plans/fr_base.py --power --spread 0.5    # what it finds and costs, before any GPU hour
#   python demo.py plans/fr_base.py --slurm                 # every step a SLURM job (sbatch options below)
# The paths are placeholders for your copies (README.md, Real data); with one pretraining seed an arm the design
# gives no interval over pretraining seeds: --power says how many it needs, give them in `seeds`.
out = "out/study_fr_base"
base = "checkpoints/moderncamembert-base"  # <- a local copy of ModernCamemBERT-base (almanach)
# French 10B: literature 7B (articles written as often as their quality upsampling says), synthetic QA 2B, E3C
# clinical cases 400M, EMA drug leaflets 600M, tokenized with the base's tokenizer
domain = ["fr/literature.jsonl", "fr/synthetic_qa.jsonl", "fr/e3c_cases.jsonl", "fr/ema_leaflets.jsonl"]
domain_weights = [7, 2, 0.4, 0.6]
domain_tokens = "11B"  # phase 1 and the decay, no window read twice
heldout_texts = "fr/heldout.jsonl"  # <- in-domain texts none of the runs train on (the paper: DiaMED, FrACCO)
val_docs = 1000
config = ["configs/fr_base.py"]
arm_tokens = 10_000_000_000
arms = {"clm": ["--objective=clm"], "mlm": ["--objective=mlm"]}
seeds = {"clm": [17], "mlm": [17, 42]}  # the paper's: both arms at 17, the MLM arm's twin at 42 for the control
cka_n = 500
cka_len = 512
suite = "suites/fr_bio.py"
finetune = {}  # the suite's: the English protocol, as the paper gives no French one
sbatch = {"train": ["--nodes=1", "--gpus-per-node=4"],  # 4 GPUs a run (slurm/train.sbatch requeues itself)
          "gpu": ["--gpus-per-node=1"], "all": ["--time=24:00:00"]}
# Base, 4 x 8192 packed, compiled, CLM (MLM 250k): one H200, results/h200-2026-11-27 (call5)
train_tokens_per_s = 269_000
