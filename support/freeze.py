"""
Freezing layers during some phases (the paper's freeze experiments). While a phase freezes them, the
layers' parameters do not require gradients: backward still flows through the layers to those below,
but computes no weight gradient for them, and DDP (rebuilt when the trainable set changes, since it
all-reduces the parameters that required a gradient when it was built) has none to all-reduce.

freeze_mode "exact": the frozen parameters get no gradient, so AdamW skips them: bit-identical, no
optimizer state touched. "zero_grad": their gradients are zeros after each backward, as the paper
words it, so decoupled AdamW still decays them and its moments from earlier steps still move them.
"""

import re

import torch

MODES = ("exact", "zero_grad")


class Freeze:
    def __init__(self, c, model, phase_names):
        """The layers of c.freeze_layers ("0-7,10"), frozen in the phases of c.freeze_phase, as c.freeze_mode says."""
        if c.freeze_mode not in MODES:
            raise SystemExit(f"freeze_mode={c.freeze_mode!r}: choose {' or '.join(MODES)}")
        layers = set()
        for part in filter(None, c.freeze_layers.replace(" ", "").split(",")):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not m:
                raise SystemExit(f"freeze_layers={c.freeze_layers!r}: write layer ranges like '0-7' or '8-14,20'")
            layers.update(range(int(m[1]), int(m[2] or m[1]) + 1))
        n_layers = model.config.num_hidden_layers
        if layers and max(layers) >= n_layers:
            raise SystemExit(f"freeze_layers={c.freeze_layers!r}: the model has layers 0-{n_layers - 1}")
        self.params = [p for i in sorted(layers) for p in model.model.layers[i].parameters()]
        self.phases = set(phase_names if c.freeze_phase == "all" else c.freeze_phase.split(","))
        self.mode, self.frozen = c.freeze_mode, False

    def enter(self, phase):
        """Set which parameters train in `phase`; True when that changed (a DDP wrapper must then be rebuilt)."""
        frozen = bool(self.params) and phase.name in self.phases
        if frozen == self.frozen:
            return False
        for p in self.params:
            p.requires_grad_(not frozen)
        self.frozen = frozen
        return True

    def after_backward(self):
        """freeze_mode "zero_grad": the frozen parameters' gradients are zeros (what AdamW then does with them
        is decay and momentum); "exact": they stay None, and AdamW leaves those parameters as they are."""
        if self.frozen and self.mode == "zero_grad":
            for p in self.params:
                p.grad = torch.zeros_like(p)
