# French Base: ModernCamemBERT-base -> French biomedical text, 10B + 1B tokens (the paper: about 4.5 h on 4 H100).
#   torchrun --nproc_per_node=4 train.py configs/fr_base.py
# Everything not set here is train.py's default: its Config names each one's source (the paper, ModernBERT's
# pretraining recipe that the paper follows, or our choice).
# Stack an ablation after it: train.py configs/fr_base.py configs/mlm_baseline.py

init_from = "checkpoints/moderncamembert-base"  # <- your local copy of ModernCamemBERT-base (almanach) (config.json, model.safetensors, tokenizer.json)
data_dir = "data/fr_bio"  # <- python data.py --input CORPUS.jsonl --tokenizer checkpoints/moderncamembert-base --out data/fr_bio
out_dir = "out/fr_base"
objective = "clm"
tokens = 10_000_000_000  # phase 1; the decay adds 1B
micro_batch_size = 4  # 4 GPUs x 4 sequences x 24 accumulation steps = 384
