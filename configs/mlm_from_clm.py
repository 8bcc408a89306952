# Gisserot-Boukhlef et al. (2025)'s other recipe: MLM continued pretraining of a CLM checkpoint, 12,000 steps at 40%
# masking (they find it beats continuing MLM from an MLM checkpoint). Stack it after a base config, for its data:
#   torchrun --nproc_per_node=4 train.py configs/en_base.py configs/mlm_from_clm.py
# init_from: the end of configs/biphasic_scratch.py's CLM phase (step 10,500; retention keeps the last checkpoint of
# every phase); set it to any CLM checkpoint, or to an MLM one for the comparison arm. The optimizer starts fresh.
# Our choice (PAPER.md gives only the 12,000 steps at 40%): the lr shape of their biphasic MLM phase (constant, the
# final 2,000 steps decaying, 1-sqrt to 0.1 lr), a warmup of 100M tokens (train.py's), train.py's other defaults.
init_from = out_dir + "_biphasic_scratch/ckpt-10500"  # <- your CLM checkpoint
phases = [
    dict(name="mlm", objective="mlm", mask_prob=0.4, steps=10_000, warmup_tokens=100_000_000),
    dict(name="decay", objective="mlm", mask_prob=0.4, steps=2_000, decay=True, final_lr_frac=0.1),
]
out_dir = out_dir + "_mlm_from_clm"
