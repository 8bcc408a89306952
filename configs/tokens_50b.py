# The 50B + 5B-token English Base run (the paper ran English Base at 10B and at 50B): its own out_dir and its own
# data_dir, since 55B tokens need a larger corpus than the 10B run's and the two runs must not mix checkpoints.
#   torchrun --nproc_per_node=4 train.py configs/en_base.py configs/tokens_50b.py                    # out/en_base_50b
#   torchrun --nproc_per_node=4 train.py configs/en_base.py configs/tokens_50b.py configs/mlm_baseline.py
# Prepare its data with the larger corpus: python data.py --input CORPUS_50B.jsonl ... --out data/en_bio_50b
tokens = 50_000_000_000  # phase 1; the decay adds 5B
out_dir = out_dir + "_50b"
data_dir = data_dir + "_50b"
