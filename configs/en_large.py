# English Large: ModernBERT-large -> English biomedical text, 50B + 5B tokens.
#   torchrun --nproc_per_node=4 train.py configs/en_large.py
# Everything not set here is train.py's default: its Config names each one's source (the paper, ModernBERT's
# pretraining recipe that the paper follows, or our choice).
# Stack an ablation after it: train.py configs/en_large.py configs/mlm_baseline.py

init_from = "checkpoints/ModernBERT-large"  # <- your local copy of answerdotai/ModernBERT-large (config.json, model.safetensors, tokenizer.json)
# The 50B corpus, as for en_base + tokens_50b (one tokenizer for Base and Large), not the 10B run's data/en_bio:
data_dir = "data/en_bio_50b"  # <- python data.py --input CORPUS_50B.jsonl --tokenizer checkpoints/ModernBERT-large --out data/en_bio_50b
out_dir = "out/en_large"
objective = "clm"
tokens = 50_000_000_000  # phase 1; the decay adds 5B
micro_batch_size = 2  # 4 GPUs x 2 sequences x 48 accumulation steps = 384
