# The CPU demo: a tiny ModernBERT on the built-in docstring corpus, minutes on a laptop.
# demo.py runs it for every arm; by hand, after
#   python data.py --demo general --tokenizer bpe:4096 --out out/demo/data/general
#   python data.py --demo domain --tokenizer out/demo/data/general --out out/demo/data/domain
# it is: python train.py configs/demo.py --init_from=scratch --objective=mlm --data_dir=out/demo/data/general
data_dir = "out/demo/data/domain"
out_dir = "out/demo/run"
init_from = "scratch"
model_config = {"hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 6, "num_attention_heads": 4,
                "local_attention": 64}
seq_len = 256
# 1,024 tokens a step, as fast per token on 2 cores as 4,096: the 10% decay of 600k tokens is then 59 optimizer
# steps, enough for the detour's MLM loss to level off (with 16 sequences it was 15 steps, still falling fast).
global_batch_size = 4
micro_batch_size = 4
tokens = 600_000
warmup_tokens = 40_000
lr = 1e-3  # tiny models take a larger step than train.py's 2e-4
device = "cpu"
log_interval = 5
eval_interval = 20  # 5 evaluations in the decay, its start and end included
eval_windows = 32  # 8k tokens: cheap enough to evaluate every 20 steps
ckpt_interval = 200
max_ckpts = 3  # the newest full checkpoints: 586 (the end of phase 1), 600, 645
keep_every = 100  # and weights only at 100, 200, ...: the trajectory that cka.py --runs compares
