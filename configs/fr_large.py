# French Large: ModernCamemBERT-large -> French biomedical text, 25B + 2.5B tokens.
#   torchrun --nproc_per_node=4 train.py configs/fr_large.py
# Everything not set here is train.py's default: its Config names each one's source (the paper, ModernBERT's
# pretraining recipe that the paper follows, or our choice).
# Stack an ablation after it: train.py configs/fr_large.py configs/mlm_baseline.py

init_from = "checkpoints/moderncamembert-large"  # <- your local copy of ModernCamemBERT-large (almanach) (config.json, model.safetensors, tokenizer.json)
data_dir = "data/fr_bio"  # <- python data.py --input CORPUS.jsonl --tokenizer checkpoints/moderncamembert-large --out data/fr_bio
out_dir = "out/fr_large"
objective = "clm"
tokens = 25_000_000_000  # phase 1; the decay adds 2.5B
micro_batch_size = 2  # 4 GPUs x 2 sequences x 48 accumulation steps = 384
