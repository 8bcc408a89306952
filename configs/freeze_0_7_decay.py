# Freeze intervention 2 as the paper ran it: layers 0-7 frozen during the MLM decay (the paper: the benefit is kept).
# freeze_mode "zero_grad" is the paper's mechanism: AdamW's moments from the CLM phase still move these layers
# in the decay; --freeze_mode=exact runs the clean variant (README, Freezing).
freeze_layers = "0-7"
freeze_phase = "decay"
freeze_mode = "zero_grad"
out_dir = out_dir + "_freeze0-7_decay"
