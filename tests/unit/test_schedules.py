"""Unit tests for hdet_scale.schedules: OneCycle must be torch's OneCycleLR bit for bit;
Cosine and Constant against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hdet_scale.schedules import Constant, Cosine, OneCycle


def _torch_onecycle_trace(max_lrs, total_steps, optimizer="sgd", **kwargs):
    """Drive a real optimizer with torch's OneCycleLR; return per step (0..total_steps)
    the list of group lrs and the list of group momenta (SGD momentum or Adam beta1)."""
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in max_lrs]
    groups = [{"params": [p], "lr": 0.123 * (i + 1)} for i, p in enumerate(params)]
    if optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        mom = lambda g: g["momentum"]  # noqa: E731
    else:
        opt = torch.optim.Adam(groups, lr=0.1, betas=(0.9, 0.999))
        mom = lambda g: g["betas"][0]  # noqa: E731
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=list(max_lrs), total_steps=total_steps, **kwargs)
    lrs = [[g["lr"] for g in opt.param_groups]]
    moms = [[mom(g) for g in opt.param_groups]]
    for _ in range(total_steps):
        for p in params:  # a real optimizer step (tiny gradient) before the scheduler step
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        moms.append([mom(g) for g in opt.param_groups])
    return lrs, moms


ONECYCLE_CASES = [
    # (total_steps, kwargs for both torch and OneCycle)
    (37, dict(pct_start=0.3, anneal_strategy="cos", three_phase=False)),
    (37, dict(pct_start=0.25, anneal_strategy="linear", three_phase=False)),
    (37, dict(pct_start=0.25, anneal_strategy="cos", three_phase=True)),
    (37, dict(pct_start=0.3, anneal_strategy="linear", three_phase=True, div_factor=10.0, final_div_factor=300.0)),
    (1000, dict(pct_start=0.3, anneal_strategy="cos", three_phase=False)),
    (1000, dict(pct_start=0.25, anneal_strategy="cos", three_phase=True, div_factor=7.0, final_div_factor=1e3)),
    (1000, dict(pct_start=0.3, anneal_strategy="linear", three_phase=False, div_factor=40.0,
                final_div_factor=5e4)),
    (1000, dict(pct_start=0.25, anneal_strategy="linear", three_phase=True)),
]


@pytest.mark.parametrize("total_steps,kw", ONECYCLE_CASES)
def test_onecycle_value_bit_identical_to_torch(total_steps, kw):
    max_lrs = [1.0, 3e-4]  # two parameter groups with different peaks
    lrs, _ = _torch_onecycle_trace(max_lrs, total_steps, optimizer="sgd", cycle_momentum=False, **kw)
    sched = OneCycle(total_steps=total_steps, **kw)
    for step in range(total_steps + 1):
        for g, peak in enumerate(max_lrs):
            mine = sched.value(step, peak)
            assert mine == lrs[step][g], (step, g, mine, lrs[step][g])


@pytest.mark.parametrize("total_steps,kw", ONECYCLE_CASES[:4] + ONECYCLE_CASES[5:6])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_onecycle_momentum_bit_identical_to_torch(total_steps, kw, optimizer):
    mom_kw = dict(base_momentum=0.8, max_momentum=0.93)
    _, moms = _torch_onecycle_trace([0.5, 0.05], total_steps, optimizer=optimizer, cycle_momentum=True,
                                    **mom_kw, **kw)
    sched = OneCycle(total_steps=total_steps, **mom_kw, **kw)
    for step in range(total_steps + 1):
        mine = sched.momentum(step)
        for g in range(2):
            assert mine == moms[step][g], (step, g, mine, moms[step][g])


def test_onecycle_default_momentum_matches_torch_adam_defaults():
    _, moms = _torch_onecycle_trace([0.01], 37, optimizer="adam", cycle_momentum=True)
    sched = OneCycle(total_steps=37)
    assert [sched.momentum(s) for s in range(38)] == [m[0] for m in moms]


def test_onecycle_endpoints_and_floor_by_hand():
    sched = OneCycle(total_steps=100, pct_start=0.25, div_factor=25.0, final_div_factor=1e4)
    peak = 2.0
    # (torch's cos anneal, end + (start - end) / 2 * 2, is not exact at pct 0: approx here;
    # bit-exactness against torch itself is checked above)
    assert sched.value(0, peak) == pytest.approx(peak / 25.0, rel=1e-14)
    # phase 1 ends at step 0.25 * 100 - 1 = 24: the peak
    assert sched.value(24, peak) == pytest.approx(peak, rel=1e-15)
    # last phase ends at step total_steps - 1 with the floor
    assert sched.value(99, peak) == pytest.approx(peak / 25.0 / 1e4, rel=1e-12)
    assert sched.floor(peak) == peak / 25.0 / 1e4
    assert sched.floor(peak) == pytest.approx(8e-6, rel=1e-15)
    # mid-way through the cosine decay: (24 + 99) / 2 = 61.5 -> average of peak and floor
    mid = 0.5 * (peak + peak / 25.0 / 1e4)
    assert (sched.value(61, peak) + sched.value(62, peak)) / 2 == pytest.approx(mid, rel=1e-3)


def test_onecycle_momentum_endpoints_by_hand():
    sched = OneCycle(total_steps=100, pct_start=0.25, base_momentum=0.8, max_momentum=0.95)
    assert sched.momentum(0) == pytest.approx(0.95, abs=1e-15)
    assert sched.momentum(24) == pytest.approx(0.8, abs=1e-15)
    assert sched.momentum(99) == pytest.approx(0.95, abs=1e-15)


def test_onecycle_past_total_steps_raises():
    sched = OneCycle(total_steps=10)
    sched.value(10, 1.0)  # the schedule is defined on 0 .. total_steps, like torch
    with pytest.raises(ValueError):
        sched.value(11, 1.0)


def test_cosine_hand_values():
    s = Cosine(total_steps=100, warmup_steps=10, min_ratio=0.1)
    peak = 2.0
    # linear warm-up: peak * (step + 1) / warmup
    assert s.value(0, peak) == pytest.approx(0.2, rel=1e-15)
    assert s.value(4, peak) == pytest.approx(1.0, rel=1e-15)
    assert s.value(9, peak) == pytest.approx(2.0, rel=1e-15)
    # start of decay: peak
    assert s.value(10, peak) == pytest.approx(2.0, rel=1e-15)
    # half-way through the decay (pct = 45 / 90): average of peak and peak * min_ratio
    assert s.value(55, peak) == pytest.approx((2.0 + 0.2) / 2, rel=1e-15)
    # pct = 30 / 90 = 1/3: 0.2 + 1.8 / 2 * (cos(pi/3) + 1) = 0.2 + 0.9 * 1.5
    assert s.value(40, peak) == pytest.approx(0.2 + 0.9 * 1.5, rel=1e-14)
    # end and past the end: the floor
    assert s.value(100, peak) == pytest.approx(0.2, rel=1e-15)
    assert s.value(150, peak) == pytest.approx(0.2, rel=1e-15)
    assert s.floor(peak) == pytest.approx(0.2, rel=1e-15)
    with pytest.raises(ValueError):
        s.momentum(3)


def test_cosine_without_warmup_starts_at_peak():
    s = Cosine(total_steps=20, warmup_steps=0, min_ratio=0.0)
    assert s.value(0, 3.0) == 3.0
    assert s.value(10, 3.0) == pytest.approx(1.5, rel=1e-15)
    assert s.value(20, 3.0) == pytest.approx(0.0, abs=1e-15)


def test_constant_hand_values():
    s = Constant(total_steps=50, warmup_steps=4)
    assert s.value(0, 2.0) == pytest.approx(0.5, rel=1e-15)
    assert s.value(1, 2.0) == pytest.approx(1.0, rel=1e-15)
    assert s.value(3, 2.0) == 2.0
    assert s.value(4, 2.0) == 2.0
    assert s.value(50, 2.0) == 2.0
    assert s.floor(2.0) == 2.0
    assert Constant(total_steps=5).value(0, 0.7) == 0.7
    with pytest.raises(ValueError):
        s.momentum(0)


def test_cosine_matches_math_on_all_steps():
    s = Cosine(total_steps=30, warmup_steps=5, min_ratio=0.25)
    for step in range(31):
        if step < 5:
            want = 1.5 * (step + 1) / 5
        else:
            pct = (step - 5) / 25
            want = 1.5 * 0.25 + (1.5 - 1.5 * 0.25) * 0.5 * (1 + math.cos(math.pi * pct))
        assert s.value(step, 1.5) == pytest.approx(want, rel=1e-14)
