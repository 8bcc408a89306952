# Biphasic pretraining from scratch (Gisserot-Boukhlef et al., 2025): CLM at a constant lr, then MLM at a
# constant lr, then a short MLM decay, with one optimizer state throughout. Their best fixed-budget schedules
# put 25-50% of the steps on CLM; here 25% of a 10B-token budget. Stack it after a base config, for its data:
#   torchrun --nproc_per_node=4 train.py configs/en_base.py configs/biphasic_scratch.py
# Not from their paper (set your own): the 30% masking (this project's MLM arm), the 100M-token warmup, and
# the decay's length and end (1B tokens, 1-sqrt to 0.1 lr, as this project's decay phase).
init_from = "scratch"
model_size = "base"
phases = [
    dict(name="clm", objective="clm", tokens=2.5e9, warmup_tokens=100e6),
    dict(name="mlm", objective="mlm", mask_prob=0.3, tokens=6.5e9),
    dict(name="decay", objective="mlm", mask_prob=0.3, tokens=1e9, decay=True, final_lr_frac=0.1),
]
out_dir = out_dir + "_biphasic_scratch"
