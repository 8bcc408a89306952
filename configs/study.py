# The study on real text (results/h200-2026-11-28): a small ModernBERT, its base pretrained with MLM on general
# English (configs/study_base.py, stacked after this one), then from that base on biomedical text the CLM detour arm
# and the MLM arm, each ending in the 10% MLM decay. plans/h200.py runs it and sets data_dir, out_dir, init_from,
# objective, seed, keep_every, and tokens: the run's, 0.657 times the size below (the factor its time rule gave).
# Fixed before the GPU run; our choices unless a source is named.
model_config = {"hidden_size": 512, "intermediate_size": 768, "num_hidden_layers": 10, "num_attention_heads": 8,
                "max_position_embeddings": 1024}  # Base's shape, narrower: heads of 64, GeGLU 1.5x, 128-token window,
# layers 0, 3, 6, 9 global (the last one too, as in Base); 31.0M parameters with the study's 16,384-token BPE
seq_len = 1024  # ModernBERT's pretraining length (the paper's 8,192 is for long documents; ours are ~2,000 tokens)
global_batch_size = 32  # 32,768 tokens a step: ~550 steps an arm at 18M tokens
micro_batch_size = 32
tokens = 30_000_000  # an arm's phase 1 (3 passes over the biomedical corpus) before the time rule scales it
warmup_tokens = 1_000_000  # ~30 steps
lr = 2.5e-4  # the base's peak lr / 4: the paper's continued pretraining peak (2e-4) over ModernBERT's own (8e-4)
eval_interval = 100
ckpt_interval = 1_000_000  # the phase ends and the final checkpoint only: the study runs minutes
