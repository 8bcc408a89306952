# Freeze intervention 3 as the paper ran it: layers 8-14 frozen during the CLM phase (the paper: the benefit is kept).
# freeze_mode "zero_grad" is the paper's mechanism; --freeze_mode=exact runs the clean variant (README, Freezing).
freeze_layers = "8-14"
freeze_phase = "main"
freeze_mode = "zero_grad"
out_dir = out_dir + "_freeze8-14_clm"
