"""The papers' runs as written (issue 33): the freeze interventions with the paper's mechanism, a phase given in
optimizer steps, Gisserot-Boukhlef's biphasic schedule and their MLM continued pretraining, training past a
checkpoint's positions, the sources of the defaults, and what a run with phases shows and keeps."""

import os

import pytest

from train import parse_config
from test_train import ROOT


def config(*names, argv=()):
    return parse_config([os.path.join(ROOT, "configs", n) for n in names] + list(argv))


# -----------------------------------------------------------------------------
# 1. The freeze configs run the paper's freeze


@pytest.mark.parametrize("name, layers, phase", [("freeze_0_7_clm.py", "0-7", "main"),
                                                 ("freeze_0_7_decay.py", "0-7", "decay"),
                                                 ("freeze_8_14_clm.py", "8-14", "main")])
def test_freeze_configs_parse_to_the_papers_zero_grad(name, layers, phase):
    for base in ("fr_base.py", "en_base.py"):
        c = config(base, name)
        assert (c.freeze_layers, c.freeze_phase, c.freeze_mode) == (layers, phase, "zero_grad")
    assert config("fr_base.py", name, argv=["--freeze_mode=exact"]).freeze_mode == "exact"  # the clean variant
