# English Base: ModernBERT-base -> English biomedical text, 10B + 1B tokens (the paper also ran 50B + 5B: stack
# configs/tokens_50b.py, which gives that run its own out_dir and data_dir).
#   torchrun --nproc_per_node=4 train.py configs/en_base.py
# Everything not set here is train.py's default: its Config names each one's source (the paper, ModernBERT's
# pretraining recipe that the paper follows, or our choice).
# Stack an ablation after it: train.py configs/en_base.py configs/mlm_baseline.py

init_from = "checkpoints/ModernBERT-base"  # <- your local copy of answerdotai/ModernBERT-base (config.json, model.safetensors, tokenizer.json)
data_dir = "data/en_bio"  # <- python data.py --input CORPUS.jsonl --tokenizer checkpoints/ModernBERT-base --out data/en_bio
out_dir = "out/en_base"
objective = "clm"
tokens = 10_000_000_000  # phase 1; the decay adds 1B
micro_batch_size = 4  # 4 GPUs x 4 sequences x 24 accumulation steps = 384
