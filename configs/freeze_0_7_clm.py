# Freeze intervention 1: layers 0-7 get no update during the CLM phase (the paper: the benefit is gone).
freeze_layers = "0-7"
freeze_phase = "main"
out_dir = out_dir + "_freeze0-7_clm"
