# The MLM baseline arm: same data, budget, schedule and seeds; phase 1 is MLM at 30%.
objective = "mlm"
out_dir = out_dir + "_mlm"
