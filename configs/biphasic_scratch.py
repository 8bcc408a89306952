# Gisserot-Boukhlef et al. (2025)'s biphasic schedule from scratch, in optimizer steps as they give it, with one
# optimizer state throughout. Stack it after a base config, for its data and tokenizer:
#   torchrun --nproc_per_node=4 train.py configs/en_base.py configs/biphasic_scratch.py
# Their recipe: a budget of 42,000 steps (their others: 12,000 and 22,000), CLM for the first 25% (they find
# 25-50% best), no lr decay before the switch, then MLM at 40% masking (their default), the lr decaying only in the
# final 2,000 steps of the MLM phase. For another budget or CLM share change the steps; the decay stays 2,000.
# Our choice (PAPER.md does not give theirs): the 2,000-step warmup, the decay's shape and end (1-sqrt to 0.1 lr,
# as this project's decay), and train.py's other defaults (lr, batch, seq_len: see its Config). Steps do not move
# with global_batch_size or seq_len: set those to yours.
# Not reproduced: their models (RoPE, RMSNorm, SwiGLU; 210M, 610M and 1B parameters). This trains ModernBERT-base
# (149M), so it reproduces their schedule, not their models.
init_from = "scratch"
model_size = "base"
phases = [
    dict(name="clm", objective="clm", steps=10_500, warmup_steps=2_000),  # 25% of 42,000 steps, then constant lr
    dict(name="mlm", objective="mlm", mask_prob=0.4, steps=29_500),  # the MLM phase at a constant lr,
    dict(name="decay", objective="mlm", mask_prob=0.4, steps=2_000, decay=True, final_lr_frac=0.1),  # its last 2,000
]
out_dir = out_dir + "_biphasic_scratch"
