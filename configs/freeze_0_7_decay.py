# Freeze intervention 2: layers 0-7 get no update during the MLM decay (the paper: the benefit is kept).
freeze_layers = "0-7"
freeze_phase = "decay"
out_dir = out_dir + "_freeze0-7_decay"
