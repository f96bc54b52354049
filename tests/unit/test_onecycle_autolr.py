"""Unit tests for hdet_scale.OneCycleAutoLR in one process (no
torch.distributed): it must then be ``torch.optim.lr_scheduler.OneCycleLR``, float for
float, whatever the HDET arguments.

Expected values come from torch's own ``OneCycleLR`` driving an identical optimizer;
comparisons are exact (``==``): both compute the same float expressions.
"""

from __future__ import annotations

import inspect
import io
import warnings

import pytest
import torch

from hdet_scale import OneCycleAutoLR
from hdet_scale.errors import HDETConfigError


def make_optimizer(kind: str = "sgd", groups: int = 1) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(groups)]
    spec = [{"params": [p], "lr": 0.5 * (i + 1)} for i, p in enumerate(params)]
    if kind == "sgd":
        return torch.optim.SGD(spec, lr=1.0, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(spec, lr=1.0, betas=(0.9, 0.99))
    if kind == "adamw":
        return torch.optim.AdamW(spec, lr=1.0)
    if kind == "adagrad":
        return torch.optim.Adagrad(spec, lr=1.0)
    raise ValueError(kind)


def snapshot(opt: torch.optim.Optimizer) -> list[tuple]:
    out = []
    for g in opt.param_groups:
        out.append((g["lr"], g.get("betas"), g.get("momentum")))
    return out


CASES = {
    "defaults_sgd": dict(kind="sgd", args=dict(max_lr=0.1, total_steps=100)),
    "epochs_steps_per_epoch": dict(kind="sgd", args=dict(max_lr=0.3, epochs=4, steps_per_epoch=23)),
    "three_phase_adam": dict(kind="adam", args=dict(max_lr=1e-3, total_steps=90, three_phase=True)),
    "linear_anneal": dict(kind="adamw", args=dict(max_lr=2e-3, total_steps=77, anneal_strategy="linear",
                                                  pct_start=0.25, div_factor=10.0, final_div_factor=100.0)),
    "two_groups_list_max_lr": dict(kind="adam", groups=2,
                                   args=dict(max_lr=[1e-3, 4e-4], total_steps=60, base_momentum=[0.8, 0.85],
                                             max_momentum=(0.95, 0.9))),
    "no_cycle_momentum": dict(kind="sgd", groups=2, args=dict(max_lr=[0.1, 0.05], total_steps=50,
                                                              cycle_momentum=False)),
    "adagrad_no_momentum": dict(kind="adagrad", args=dict(max_lr=0.05, total_steps=40, cycle_momentum=False)),
    # HDET arguments without torch.distributed: R = 1, still exactly OneCycleLR.
    "hdet_args_single_process": dict(kind="adam", args=dict(max_lr=1e-3, total_steps=120),
                                     hdet=dict(ensemble_lr_spread_ratio=1 / 9, model_sync_interval=10,
                                               auto_lr_warmup_steps=20, enable_auto_lr=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_torch_onecycle_every_step(name):
    """LR and momentum (SGD momentum / Adam beta1) of every group equal OneCycleLR's at
    every step 0 .. total_steps, as do the group keys OneCycleLR writes, get_last_lr and
    last_epoch; stepping once more raises the same ValueError."""
    case = CASES[name]
    groups = case.get("groups", 1)
    ref_opt, opt = make_optimizer(case["kind"], groups), make_optimizer(case["kind"], groups)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, **case["args"])
    sched = OneCycleAutoLR(opt, **case["args"], **case.get("hdet", {}))
    for key in ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"):
        assert [g.get(key) for g in opt.param_groups] == [g.get(key) for g in ref_opt.param_groups], key
    total = ref.total_steps
    assert sched.total_steps == total
    gen = torch.Generator().manual_seed(0)
    for step in range(total + 1):
        assert snapshot(opt) == snapshot(ref_opt), f"{name}: step {step}"
        assert sched.get_last_lr() == ref.get_last_lr()
        assert sched.last_epoch == ref.last_epoch == step
        if step < total:
            ref_opt.step()
            opt.step()
            ref.step()
            sched.step(torch.rand((), generator=gen) + 1.0)
    with pytest.raises(ValueError) as ours:
        sched.step(torch.tensor(1.0))
    with pytest.raises(ValueError) as theirs:
        ref.step()
    # OneCycleLR's words, then the key that sets the length
    assert str(ours.value).startswith(str(theirs.value) + " (hdet.schedule.total_steps"), (ours.value, theirs.value)
    assert sched.step_count == total and snapshot(opt) == snapshot(ref_opt)  # state unchanged by the error


def test_positional_order_matches_onecycle():
    """A positional OneCycleLR call site works unchanged: same names in the same order."""
    torch_params = list(inspect.signature(torch.optim.lr_scheduler.OneCycleLR.__init__).parameters)
    ours = list(inspect.signature(OneCycleAutoLR.__init__).parameters)
    assert ours[:len(torch_params)] == torch_params
    kinds = inspect.signature(OneCycleAutoLR.__init__).parameters
    assert all(kinds[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ours[len(torch_params):])


def test_positional_call_equals_torch():
    ref_opt, opt = make_optimizer("sgd"), make_optimizer("sgd")
    args = (0.2, None, 3, 20, 0.4, "linear", True, 0.8, 0.9, 5.0, 50.0, True)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, *args)
    sched = OneCycleAutoLR(opt, *args)
    for _ in range(60):
        assert snapshot(opt) == snapshot(ref_opt)
        ref_opt.step()
        ref.step()
        sched.step()


def test_resume_with_last_epoch_equals_torch():
    """last_epoch = k resumes as OneCycleLR does (the next LR is that of step k + 1)."""
    args = dict(max_lr=[0.1, 0.02], total_steps=40, three_phase=True)
    ref_opt, opt = make_optimizer("sgd", 2), make_optimizer("sgd", 2)
    torch.optim.lr_scheduler.OneCycleLR(ref_opt, **args)  # writes initial_lr, which torch needs to resume
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, **args, last_epoch=12)
    sched = OneCycleAutoLR(opt, **args, last_epoch=12, ensemble_lr_spread_ratio=0.2, model_sync_interval=5)
    assert sched.last_epoch == ref.last_epoch == 13
    for _ in range(13, 40):
        assert snapshot(opt) == snapshot(ref_opt)
        ref_opt.step()
        ref.step()
        sched.step()


def test_global_rng_untouched():
    """The reference code calls torch.manual_seed(1024) in its constructor; this one
    never reads or writes the global RNG (construction, steps, syncs, state round trip)."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    opt = make_optimizer("adam")
    sched = OneCycleAutoLR(opt, 1e-3, total_steps=50, ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                           enable_auto_lr=True, auto_lr_warmup_steps=8)
    for _ in range(30):
        sched.step(torch.tensor(2.0))
    sched.load_state_dict(sched.state_dict())
    assert torch.equal(torch.random.get_rng_state(), before)


def test_state_dict_round_trip_is_exact():
    """Stop after 17 steps (mid-interval), save through torch.save, load into a fresh
    scheduler on a fresh optimizer (whose own state is loaded too): the remaining LRs and
    momenta equal the uninterrupted run. The state holds no rank."""
    args = dict(max_lr=[3e-3, 1e-3], total_steps=45)
    hdet = dict(ensemble_lr_spread_ratio=0.1, model_sync_interval=5)
    opt_a = make_optimizer("adam", 2)
    a = OneCycleAutoLR(opt_a, **args, **hdet)
    opt_b = make_optimizer("adam", 2)
    b = OneCycleAutoLR(opt_b, **args, **hdet)
    for _ in range(17):
        a.step(1.0)
        b.step(1.0)
    buf = io.BytesIO()
    torch.save({"sched": b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    assert "rank" not in saved["sched"] and saved["sched"]["step"] == 17
    opt_c = make_optimizer("adam", 2)
    c = OneCycleAutoLR(opt_c, **args, **hdet)
    opt_c.load_state_dict(saved["opt"])
    c.load_state_dict(saved["sched"])
    assert c.last_epoch == 17 and c.sync_obj.state_dict() == a.sync_obj.state_dict()
    for _ in range(17, 45):
        assert snapshot(opt_c) == snapshot(opt_a)
        a.step(1.0)
        c.step(1.0)
    assert snapshot(opt_c) == snapshot(opt_a)


def test_single_process_needs_no_loss_and_warns_nothing():
    opt = make_optimizer("sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = OneCycleAutoLR(opt, 0.1, total_steps=30, ensemble_lr_spread_ratio=0.5, model_sync_interval=3,
                               enable_auto_lr=True, auto_lr_warmup_steps=0)
        for _ in range(30):
            sched.step()
    assert sched.topology is None and sched.replicas == 1 and sched.sync_count == 10


BAD = {
    "no_total_steps": (dict(max_lr=0.1), "either total_steps OR (epochs AND steps_per_epoch)"),
    "only_epochs": (dict(max_lr=0.1, epochs=3), "either total_steps OR"),
    "zero_total_steps": (dict(max_lr=0.1, total_steps=0), "total_steps: expected a positive integer"),
    "float_total_steps": (dict(max_lr=0.1, total_steps=100.0), "total_steps: expected a positive integer"),
    "bad_epochs": (dict(max_lr=0.1, epochs=0, steps_per_epoch=5), "epochs: expected a positive integer"),
    "sync_interval_zero": (dict(max_lr=0.1, total_steps=100, model_sync_interval=0), "model_sync_interval"),
    "spread_one": (dict(max_lr=0.1, total_steps=100, ensemble_lr_spread_ratio=1.0), "ensemble_lr_spread_ratio"),
    "spread_negative": (dict(max_lr=0.1, total_steps=100, ensemble_lr_spread_ratio=-0.1),
                        "ensemble_lr_spread_ratio"),
    "loss_scale_zero": (dict(max_lr=0.1, total_steps=100, loss_scale=0.0), "loss_scale"),
    "momentum_of_lr_one": (dict(max_lr=0.1, total_steps=100, momentum_of_lr=1.0), "momentum_of_lr"),
    "lr_of_lr_negative": (dict(max_lr=0.1, total_steps=100, lr_of_lr=-1.0), "lr_of_lr"),
    "warmup_negative": (dict(max_lr=0.1, total_steps=100, auto_lr_warmup_steps=-1), "auto_lr_warmup_steps"),
    "max_lr_list_length": (dict(max_lr=[0.1, 0.2], total_steps=100), "max_lr: 2 values for 1"),
    "max_lr_zero": (dict(max_lr=0.0, total_steps=100), "max_lr: must be > 0"),
    "momentum_list_length": (dict(max_lr=0.1, total_steps=100, base_momentum=[0.8, 0.8]), "base_momentum"),
    "pct_start": (dict(max_lr=0.1, total_steps=100, pct_start=1.5), "pct_start"),
    "anneal": (dict(max_lr=0.1, total_steps=100, anneal_strategy="exp"), "anneal_strategy"),
    "div_factor": (dict(max_lr=0.1, total_steps=100, div_factor=0.0), "div_factor"),
    "last_epoch": (dict(max_lr=0.1, total_steps=100, last_epoch=-2), "last_epoch"),
    "last_epoch_past_end": (dict(max_lr=0.1, total_steps=100, last_epoch=100), "last_epoch"),
    "world_size_without_dist": (dict(max_lr=0.1, total_steps=100, world_size=8), "world_size: is 8"),
    "rank_without_dist": (dict(max_lr=0.1, total_steps=100, rank=3), "rank: is 3"),
    "model_type": (dict(max_lr=0.1, total_steps=100, model="net"), "model: must be a torch.nn.Module"),
    # Only a derived check of the schedule: a warm-up phase shorter than one step.
    "zero_length_phase": (dict(max_lr=0.1, total_steps=10, pct_start=0.1), "phase of zero or negative length"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_before_use(case):
    """Each bad argument raises HDETConfigError (a ValueError) naming it, and leaves the
    optimizer's groups untouched (checked before anything is written)."""
    kwargs, fragment = BAD[case]
    opt = make_optimizer("sgd")
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    with pytest.raises(HDETConfigError) as err:
        OneCycleAutoLR(opt, **kwargs)
    assert isinstance(err.value, ValueError)
    assert fragment in str(err.value), str(err.value)
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == before


def test_all_problems_reported_at_once():
    with pytest.raises(HDETConfigError) as err:
        OneCycleAutoLR(make_optimizer("sgd"), 0.1, total_steps=100, model_sync_interval=0, loss_scale=-1.0,
                       ensemble_lr_spread_ratio=2.0)
    text = str(err.value)
    assert all(k in text for k in ("model_sync_interval", "loss_scale", "ensemble_lr_spread_ratio"))


def test_cycle_momentum_needs_momentum_or_betas():
    """As OneCycleLR: an optimizer without momentum or beta1 cannot cycle it."""
    with pytest.raises(ValueError, match="optimizer must support momentum or beta1"):
        torch.optim.lr_scheduler.OneCycleLR(make_optimizer("adagrad"), 0.1, total_steps=10)
    with pytest.raises(HDETConfigError, match="optimizer must support momentum or beta1"):
        OneCycleAutoLR(make_optimizer("adagrad"), 0.1, total_steps=10)


def test_not_an_optimizer():
    with pytest.raises(TypeError):
        OneCycleAutoLR(object(), 0.1, total_steps=10)
