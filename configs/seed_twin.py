# The seed-noise control for CKA: the MLM arm again with another training seed
# (dropout and masking differ; the data order, data_seed, does not).
objective = "mlm"
seed = 42
out_dir = out_dir + "_mlm_seed42"
