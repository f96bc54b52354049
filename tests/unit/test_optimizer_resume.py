"""Which optimizer settings a load replaced (``backends/optimizer_resume.py``): real torch
optimizers, their own ``load_state_dict``."""

from __future__ import annotations

import pytest
import torch

from hdet_scale.backends.optimizer_resume import group_settings, kept_settings, warn_kept_settings
from hdet_scale.errors import HDETResumeWarning


def _adamw(**kw):
    return torch.optim.AdamW([torch.zeros(2, requires_grad=True)], **{"lr": 1e-3, **kw})


def test_the_settings_a_load_replaced_are_named_but_not_those_hdet_sets_again():
    saved = _adamw(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, lr=5e-3).state_dict()
    mine = _adamw(betas=(0.5, 0.6), eps=1e-8, weight_decay=0.3, lr=1e-2)
    before = group_settings(mine)
    mine.load_state_dict(saved)
    assert mine.param_groups[0]["betas"] == (0.9, 0.999)  # torch kept the checkpoint's, silently
    assert kept_settings(before, mine, axes={"lr": {}}) == ["group 0 betas: [0.5, 0.6] -> [0.9, 0.999]",
                                                            "group 0 weight_decay: 0.3 -> 0.1"]
    # an explored axis is HDET's to set again: not named; beta2 leaves beta1 compared
    assert kept_settings(before, mine, axes={"lr": {}, "weight_decay": {}, "beta2": {}}) == [
        "group 0 betas: [0.5, 0.6] -> [0.9, 0.999]"]
    with pytest.warns(HDETResumeWarning, match=r"group 0 betas: \[0.5, 0.6\] -> \[0.9, 0.999\]"):
        warn_kept_settings(before, mine, {"lr": {}})


def test_the_same_settings_and_a_tuple_read_back_as_a_list_warn_of_nothing(recwarn):
    saved = _adamw(betas=(0.9, 0.95)).state_dict()
    saved["param_groups"][0]["betas"] = [0.9, 0.95]  # DCP hands tuples back as lists
    mine = _adamw(betas=(0.9, 0.95))
    before = group_settings(mine)
    mine.load_state_dict(saved)
    assert kept_settings(before, mine, axes={"lr": {}}) == []
    warn_kept_settings(before, mine, {"lr": {}})
    assert not [w for w in recwarn if issubclass(w.category, HDETResumeWarning)]
