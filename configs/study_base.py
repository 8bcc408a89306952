# The study's base (stacked after configs/study.py): MLM from scratch on general English, then the 10% decay, as
# "a pretrained ModernBERT" is. Sizes before the study's time rule scaled them; our choices.
init_from = "scratch"
objective = "mlm"
tokens = 100_000_000  # 4 passes over the 25M-token Gutenberg corpus
warmup_tokens = 3_000_000  # ~90 steps
lr = 1e-3  # a small model's pretraining peak (Pythia-70M's)
eval_interval = 500
