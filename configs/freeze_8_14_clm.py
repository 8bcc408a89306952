# Freeze intervention 3: layers 8-14 get no update during the CLM phase (the paper: the benefit is kept).
freeze_layers = "8-14"
freeze_phase = "main"
out_dir = out_dir + "_freeze8-14_clm"
