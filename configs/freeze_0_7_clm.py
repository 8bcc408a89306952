# Freeze intervention 1 as the paper ran it: layers 0-7 frozen during the CLM phase (the paper: the benefit is gone).
# freeze_mode "zero_grad" is the paper's mechanism; --freeze_mode=exact runs the clean variant (README, Freezing).
freeze_layers = "0-7"
freeze_phase = "main"
freeze_mode = "zero_grad"
out_dir = out_dir + "_freeze0-7_clm"
