"""Unit tests for hdet_scale.simulate (R HDET replicas in one process).

Expected values come from independent computations: a single model trained with torch's
own optimizers and ``OneCycleLR``, means taken with ``torch.stack(...).mean(0)``, and the
fan-out multipliers written out by hand. Models are tiny and all data comes from seeded
``torch.Generator`` objects (the global RNG is never used).
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from hdet_scale import Simulator, SimulatedSync
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError

D_IN, D_OUT = 4, 3

# The paper's update, fitness and per-group exploration, set explicitly where a test checks
# the paper semantics (the defaults are the log controller, probe fitness, tied groups).
PAPER = {"controller": "paper", "fitness": "train_loss", "groups": "independent"}


class Tiny(nn.Module):
    """Linear + LayerNorm (+ optional BatchNorm for persistent buffers, and a
    non-persistent buffer that converge must leave alone)."""

    def __init__(self, seed: int = 0, batchnorm: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(D_IN, D_OUT)
        self.norm = nn.LayerNorm(D_OUT)
        self.bn = nn.BatchNorm1d(D_OUT) if batchnorm else None
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.lin(x))
        return self.bn(y) if self.bn is not None else y


def make_data(steps: int, replicas: int, seed: int = 1, batch: int = 8):
    """data[t][r] = (x, y) for step t and replica r."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, D_IN, generator=g), torch.randn(batch, D_OUT, generator=g))
             for _ in range(replicas)] for _ in range(steps)]


def loss_for(data, t):
    def fn(model, r):
        x, y = data[t][r]
        return nn.functional.mse_loss(model(x), y)
    return fn


def hdet(replicas=2, sync_interval=4, total_steps=10, spread=0.0, sharing="global", auto=None, seed=0):
    block = {"replicas": replicas, "sync_interval": sync_interval, "gradient_sharing": sharing, "seed": seed,
             "axes": {"lr": {"spread_ratio": spread}},
             "schedule": {"name": "onecycle", "total_steps": total_steps}}
    if auto is not None:
        block["auto"] = auto
    return block


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def capture_converge(sim):
    """Wrap sim.sync.converge to record every replica's params/buffers just before it."""
    seen = []
    orig = sim.sync.converge

    def wrapped(finite):
        seen.append({"finite": list(finite),
                     "state": [{k: v.clone() for k, v in m.state_dict().items()} for m in sim.models]})
        orig(finite)

    sim.sync.converge = wrapped
    return seen


# ---- (a) spread 0 + global sharing == one model on the mean loss ------------------------
@pytest.mark.parametrize("opt_fn", [sgd, adamw], ids=["sgd", "adamw"])
def test_spread_zero_global_equals_single_model_on_mean_loss(opt_fn):
    steps = 10
    data = make_data(steps, 2)
    sim = Simulator(lambda: Tiny(seed=3), opt_fn, hdet(replicas=2, sync_interval=4, total_steps=steps))

    ref = Tiny(seed=3)
    opt = opt_fn(list(ref.parameters()))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"], total_steps=steps,
                                                cycle_momentum=False)
    for t in range(steps):
        sim.step(loss_for(data, t))
        opt.zero_grad()
        loss = 0.5 * (loss_for(data, t)(ref, 0) + loss_for(data, t)(ref, 1))
        loss.backward()
        opt.step()
        if t < steps - 1:  # OneCycleLR raises past total_steps; HDET clamps there
            sched.step()
            assert sim.optimizers[0].param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)

    # Identical gradients and LRs: the replicas stay bit-identical.
    for a, b in zip(sim.models[0].parameters(), sim.models[1].parameters()):
        assert torch.equal(a, b)
    # float32: the mean of the two replicas' gradients and the gradient of the mean loss
    # differ only by rounding (summation order inside autograd), so compare to a few ulps
    # of accumulated drift over 10 steps.
    for p, q in zip(sim.models[0].parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---- (b) converge = mean of the pre-sync replicas, params and persistent buffers ------
def test_converge_writes_mean_of_pre_sync_params_into_every_replica():
    R, T = 3, 3
    data = make_data(T, R)
    sim = Simulator(lambda: Tiny(seed=5, batchnorm=True), sgd,
                    hdet(replicas=R, sync_interval=T, total_steps=12, spread=0.3, sharing="replica"))
    for r, m in enumerate(sim.models):
        m.scratch.fill_(float(r))  # non-persistent: must survive converge untouched
    seen = capture_converge(sim)
    for t in range(T):
        sim.step(loss_for(data, t))
    assert len(seen) == 1 and seen[0]["finite"] == [True] * R
    pre = seen[0]["state"]
    # The replicas had diverged (different LRs, different data, own gradients).
    assert not torch.equal(pre[0]["lin.weight"], pre[1]["lin.weight"])
    assert not torch.equal(pre[0]["bn.running_mean"], pre[1]["bn.running_mean"])
    for key in pre[0]:
        after = [m.state_dict()[key] for m in sim.models]
        for r in range(1, R):
            assert torch.equal(after[r], after[0]), key
        if pre[0][key].is_floating_point():
            expected = torch.stack([s[key] for s in pre]).mean(0)
            torch.testing.assert_close(after[0], expected, rtol=1e-6, atol=1e-7)
        else:  # num_batches_tracked: integer, not averaged (equal anyway)
            assert torch.equal(after[0], pre[0][key])
    for r, m in enumerate(sim.models):
        assert torch.equal(m.scratch, torch.full((2,), float(r)))


def test_converge_passthrough_averages_without_sync():
    sim = Simulator(lambda: Tiny(seed=2), sgd, hdet(replicas=2, sync_interval=100, total_steps=100,
                                                    spread=0.5, sharing="replica"))
    data = make_data(2, 2)
    for t in range(2):
        sim.step(loss_for(data, t))
    pre = [params_of(m) for m in sim.models]
    sim.converge()
    for i, p in enumerate(sim.models[1].parameters()):
        assert torch.equal(p, list(sim.models[0].parameters())[i])
        torch.testing.assert_close(p, (pre[0][i] + pre[1][i]) / 2, rtol=0, atol=0)
    assert sim.scheduler.sync_count == 0


def test_the_last_step_converges_when_it_is_no_sync_step():
    """5 steps at T = 2 end with the replicas averaged, so that what the library and
    HDETTrainer save is the ensemble's model, not replica 0's weights: the scheduler
    converges at last_step: before it the replicas differ, after it every replica holds
    the exact mean of what they held (converge's own mean, atol 0), logged as a sync
    without a meta-update."""
    auto = {"enabled": True, "fitness": "train_loss", "warmup_steps": 0, "controller": "log"}
    sim = Simulator(lambda: Tiny(seed=2), sgd, hdet(replicas=2, sync_interval=2, total_steps=5, spread=0.5,
                                                    sharing="replica", auto=auto))
    data = make_data(5, 2)
    for t in range(4):
        sim.step(loss_for(data, t))
    lrs = [[g["lr"] for g in o.param_groups] for o in sim.optimizers]
    meta_before = copy.deepcopy(sim.scheduler.controller.state_dict())
    seen = []
    orig = sim.sync.converge
    sim.sync.converge = lambda finite: (seen.append([params_of(m) for m in sim.models]), orig(finite))[1]
    sim.step(loss_for(data, 4))
    assert len(seen) == 1 and sim.scheduler.sync_count == 3 and sim.scheduler.converged_step == 5
    # logged as a sync without a meta-update, so that the end leaves a record
    rec = sim.scheduler.last_sync
    assert rec["hdet/step"] == 5 and rec["hdet/final_converge"] == 1 and "hdet/loss/replica_1" in rec, rec
    assert not any(k.startswith("hdet/weight/") for k in rec), rec  # no meta-update at the end
    assert sim.scheduler.controller.state_dict() == meta_before  # nor a move of the base
    pre = seen[0]
    assert any(not torch.equal(a, b) for a, b in zip(pre[0], pre[1]))  # step 5 ran apart
    for i, p in enumerate(sim.models[0].parameters()):
        assert torch.equal(p, list(sim.models[1].parameters())[i])
        torch.testing.assert_close(p, (pre[0][i] + pre[1][i]) / 2, rtol=0, atol=0)
    assert lrs[0] != lrs[1]  # the spread itself was there
    # a resume from the end's checkpoint knows the end converged (hdet-train's loop then
    # does not average again)
    again = Simulator(lambda: Tiny(seed=2), sgd, hdet(replicas=2, sync_interval=2, total_steps=5, spread=0.5,
                                                      sharing="replica", auto=auto))
    again.load_state_dict(sim.state_dict())
    assert again.scheduler.converged_step == again.scheduler.step_count == 5


def test_a_run_stopped_before_total_steps_resumes_as_the_uninterrupted_run():
    """hdet-train with train.steps (last_step) shorter than total_steps does not average
    the replicas at its last step, before its checkpoint (a resume up to total_steps
    would then part from the uninterrupted run): that step is like any other: the state
    after step 5 (models, optimizers, HDET state) equals that of a run going on to 10; a
    resume from it ends bit-for-bit (atol 0) as the uninterrupted run; ``finish()``
    afterwards averages the replicas (their exact mean) and logs it, leaving the sync
    count, permutations and controller alone."""
    auto = {"enabled": True, "fitness": "train_loss", "warmup_steps": 0, "controller": "log"}
    data = make_data(10, 2)

    def sim_for(last):
        sim = Simulator(lambda: Tiny(seed=2), sgd, hdet(replicas=2, sync_interval=2, total_steps=10, spread=0.5,
                                                        sharing="replica", auto=auto))
        sim.scheduler.last_step = last
        return sim

    short, whole = sim_for(5), sim_for(10)
    for t in range(5):
        short.step(loss_for(data, t))
        whole.step(loss_for(data, t))
    saved = copy.deepcopy(short.state_dict())  # hdet-train's checkpoint: before finish()
    a, b = short.scheduler.state_dict(), whole.scheduler.state_dict()
    assert a["sync_count"] == b["sync_count"] == 2 and a["permutations"] == b["permutations"]
    assert a["controller"] == b["controller"] and a["sync"] == b["sync"]
    assert torch.equal(a["generator"], b["generator"])
    apart = [params_of(m) for m in short.models]
    assert any(not torch.equal(p, q) for p, q in zip(*apart))  # step 5 is no sync: still apart
    for m, n in zip(short.models, whole.models):
        for p, q in zip(m.parameters(), n.parameters()):
            assert torch.equal(p, q)
    rec = short.scheduler.finish()
    assert rec["hdet/final_converge"] == 1 and rec["hdet/step"] == 5 and "hdet/sync" not in rec, rec
    assert short.scheduler.finish() is None  # once
    after = short.scheduler.state_dict()
    assert after["sync_count"] == 2 and after["permutations"] == a["permutations"] and after["sync"] == a["sync"]
    for i, p in enumerate(short.models[0].parameters()):
        torch.testing.assert_close(p, (apart[0][i] + apart[1][i]) / 2, rtol=0, atol=0)
        assert torch.equal(p, list(short.models[1].parameters())[i])
    resumed = sim_for(10)
    resumed.load_state_dict(saved)
    for t in range(5, 10):
        resumed.step(loss_for(data, t))
        whole.step(loss_for(data, t))
    assert whole.scheduler.finish() is None  # step 10 synced
    for m, n in zip(resumed.models, whole.models):
        for p, q in zip(m.parameters(), n.parameters()):
            assert torch.equal(p, q)


# ---- (c) replica LRs = base x multiplier[perm[r]] ---------------------------------------
def test_replica_lrs_are_base_times_permuted_multipliers():
    R, T, N, a, seed = 3, 2, 8, 0.2, 7
    sim = Simulator(lambda: Tiny(), sgd, hdet(replicas=R, sync_interval=T, total_steps=N, spread=a, seed=seed))
    mult = [1 - a, 1.0, 1 + a]  # R = 3: delta = 1, offsets -1, 0, 1
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    onecycle = torch.optim.lr_scheduler.OneCycleLR(dummy, max_lr=0.1, total_steps=N, cycle_momentum=False)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(R, generator=gen).tolist()
    data = make_data(N, R)
    seen_perms = {tuple(perm)}
    for t in range(N):
        base = dummy.param_groups[0]["lr"]
        assert sim.scheduler.permutations[("lr", 0)] == perm
        for r in range(R):
            assert sim.optimizers[r].param_groups[0]["lr"] == pytest.approx(base * mult[perm[r]], rel=1e-12)
        sim.step(loss_for(data, t))
        if t < N - 1:
            dummy.step()  # no gradient: a no-op that keeps torch's call-order check quiet
            onecycle.step()
        if (t + 1) % T == 0:
            perm = torch.randperm(R, generator=gen).tolist()
            seen_perms.add(tuple(perm))
    assert len(seen_perms) > 1  # permutations really are redrawn at syncs


# ---- (d) NaN on one replica for an interval ---------------------------------------------
def test_nan_replica_is_left_out_and_receives_the_others_params():
    R, T, N = 2, 3, 12
    data = make_data(N, R)
    # decay 0: with the derived decay this short run drives the base LR negative even
    # without a NaN (see test_auto_lr_base_stays_positive_with_derived_decay).
    cfg = hdet(replicas=R, sync_interval=T, total_steps=N, spread=0.2, sharing="replica",
               auto={"enabled": True, "warmup_steps": 0, "temperature": 0.1, "decay": 0.0, **PAPER})
    sim = Simulator(lambda: Tiny(seed=1), sgd, cfg)
    seen = capture_converge(sim)

    def fn_for(t):
        base = loss_for(data, t)

        def fn(model, r):
            loss = base(model, r)
            return loss * float("nan") if (r == 1 and T <= t < 2 * T) else loss
        return fn

    for t in range(2 * T):
        sim.step(fn_for(t))
    assert [s["finite"] for s in seen] == [[True, True], [True, False]]
    assert sim.scheduler.last_sync["hdet/nonfinite_replicas"] == [1]
    assert math.isnan(sim.scheduler.last_sync["hdet/loss/replica_1"])
    pre = seen[1]["state"]
    assert any(torch.isnan(v).any() for v in pre[1].values())  # replica 1 really blew up
    for m in sim.models:
        for k, v in m.state_dict().items():
            assert torch.equal(v, pre[0][k]), k  # mean over one contributor = replica 0
    base = sim.scheduler.base_value("lr", 0)
    assert math.isfinite(base) and base > 0
    assert all(math.isfinite(v) and v > 0 for v in sim.scheduler.replica_values("lr", 0))
    for t in range(2 * T, N):  # and training continues finitely on both
        losses = sim.step(loss_for(data, t))
        assert all(torch.isfinite(x) for x in losses)


def test_auto_lr_base_stays_positive_with_derived_decay():
    """A strong derived decay (gamma ~ 0.95) lets the velocity outweigh base * (1 - gamma);
    the base is floored at the schedule's final LR instead of going negative."""
    R, T, N = 2, 3, 12
    data = make_data(N, R)
    cfg = hdet(replicas=R, sync_interval=T, total_steps=N, spread=0.2, sharing="replica",
               auto={"enabled": True, "warmup_steps": 0, "temperature": 0.1, **PAPER})
    with pytest.warns(UserWarning, match="piecewise-constant decay"):  # autolr.drowning_warning
        sim = Simulator(lambda: Tiny(seed=1), sgd, cfg)
    for t in range(N):
        sim.step(loss_for(data, t))
        assert all(v > 0 for v in sim.scheduler.replica_values("lr", 0)), sim.scheduler.last_sync
        assert sim.scheduler.base_value("lr", 0) >= sim.scheduler.schedule.floor(sim.scheduler.peaks[0])


# ---- (e) state_dict round trip, mid-interval, exact --------------------------------------
def _stop_save_load_continue(cfg, data, stop, N, R, check_at_stop, probe_fn=None):
    """Run A for ``stop`` steps (``check_at_stop(A)`` must hold then), save it through
    torch.save, load it into B built with a different init (everything must come from the
    state), then step both to N: every step's losses and every replica's LR bit-identical.
    Returns ``(A, B)`` for the caller's own checks."""
    a = Simulator(lambda: Tiny(seed=4), adamw, cfg, probe_fn=probe_fn)
    for t in range(stop):
        a.step(loss_for(data, t))
    assert check_at_stop(a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = Simulator(lambda: Tiny(seed=99), adamw, cfg, probe_fn=probe_fn)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    for t in range(stop, N):
        la, lb = a.step(loss_for(data, t)), b.step(loss_for(data, t))
        assert [x.item() for x in la] == [x.item() for x in lb]
        for r in range(R):
            assert a.optimizers[r].param_groups[0]["lr"] == b.optimizers[r].param_groups[0]["lr"]
    return a, b



@pytest.mark.filterwarnings("ignore:hdet.auto. the derived decay:UserWarning")  # short paper run, on purpose
def test_state_dict_round_trip_continues_identically_mid_interval():
    R, T, N, stop = 3, 3, 12, 5  # stop after step 5: mid-interval (syncs at 3, 6, ...)
    data = make_data(N, R)
    cfg = hdet(replicas=R, sync_interval=T, total_steps=N, spread=0.2, sharing="replica",
               auto={"enabled": True, "warmup_steps": 0, "temperature": 0.1, **PAPER})
    a, b = _stop_save_load_continue(cfg, data, stop, N, R,
                                    lambda a: a.sync.state_dict()["loss_count"] == [stop - T] * R)  # mid-interval
    assert a.scheduler.base == b.scheduler.base and a.scheduler.velocity == b.scheduler.velocity
    assert a.scheduler.auto_active
    for ma, mb in zip(a.models, b.models):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(pa, pb)
    for oa, ob in zip(a.optimizers, b.optimizers):
        for pa, pb in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"]):
            assert torch.equal(oa.state[pa]["exp_avg_sq"], ob.state[pb]["exp_avg_sq"])


# ---- (f) Adam moments: shared under global sharing, divergent under replica -------------
@pytest.mark.parametrize("sharing", ["global", "replica"])
def test_adam_moments_shared_only_with_global_gradients(sharing):
    R, steps = 2, 4
    data = make_data(steps, R)
    sim = Simulator(lambda: Tiny(seed=6), adamw, hdet(replicas=R, sync_interval=100, total_steps=20,
                                                      spread=0.3, sharing=sharing))
    for t in range(steps):
        sim.step(loss_for(data, t))
    p0, p1 = list(sim.models[0].parameters()), list(sim.models[1].parameters())
    s0, s1 = sim.optimizers[0].state, sim.optimizers[1].state
    same_m = all(torch.equal(s0[a]["exp_avg"], s1[b]["exp_avg"]) for a, b in zip(p0, p1))
    same_v = all(torch.equal(s0[a]["exp_avg_sq"], s1[b]["exp_avg_sq"]) for a, b in zip(p0, p1))
    assert not all(torch.equal(a, b) for a, b in zip(p0, p1))  # params diverge through the LRs
    if sharing == "global":
        assert same_m and same_v
        for a, b in zip(p0, p1):  # and the grads are the replica mean
            assert torch.equal(a.grad, b.grad)
    else:
        assert not same_m and not same_v


# ---- SimulatedSync accumulators -----------------------------------------------------------
def test_sync_loss_accumulation_float64_and_reset():
    models = [nn.Linear(2, 2), nn.Linear(2, 2)]
    opts = [sgd(list(m.parameters())) for m in models]
    s = SimulatedSync(models, opts, "replica")
    assert s.replicas == 2 and s.local_replicas == [0, 1]
    xs = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(1e8, dtype=torch.float32), 3]
    for x in xs:
        s.add_loss([x, 2.0])
    state = s.state_dict()
    losses, counts = s.interval_losses()
    exact = (float(xs[0]) + float(xs[1]) + 3.0) / 3  # float64 arithmetic, not float32
    assert losses[0] == exact and losses[1] == 2.0 and counts == [3, 3]
    losses, counts = s.interval_losses()
    assert all(math.isnan(x) for x in losses) and counts == [0, 0]
    s.load_state_dict(state)
    assert s.interval_losses()[0][0] == exact
    with pytest.raises(ValueError, match="2 losses"):
        s.add_loss([1.0])
    with pytest.raises(ValueError):
        SimulatedSync(models, opts, "ring")


def test_replicas_start_identical_and_config_object_accepted():
    calls = []

    def model_fn():
        calls.append(1)
        return Tiny(seed=len(calls))  # different init per call: replica 0's wins

    sim = Simulator(model_fn, sgd, HDETConfig.from_dict(hdet(replicas=3)))
    assert len(calls) == 3 and sim.replicas == 3
    ref = Tiny(seed=1)
    for m in sim.models:
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    with pytest.raises(ValueError, match="scalar"):
        sim.step(lambda model, r: model(torch.zeros(2, D_IN)))


def test_stepping_past_total_steps_raises_before_any_replica_moves():
    """As ``OneCycleLR``: step ``total_steps + 1`` is an error, raised before any
    optimizer step, so the replicas keep the weights of the last valid step."""
    data = make_data(6, 2)
    sim = Simulator(Tiny, lambda p: torch.optim.SGD(p, lr=0.1), hdet(total_steps=5, spread=0.2))
    for t in range(5):
        sim.step(loss_for(data, t))
    before = [[p.detach().clone() for p in m.parameters()] for m in sim.models]
    calls = []
    with pytest.raises(ValueError, match=r"Tried to step 6 times. The specified number of total steps is 5 \(hdet.schedule.total_steps"):
        sim.step(lambda m, r: calls.append(r) or loss_for(data, 5)(m, r))
    assert calls == [] and sim.scheduler.step_count == 5
    for ps, qs in zip(before, sim.models):
        for p, q in zip(ps, qs.parameters()):
            assert torch.equal(p, q)
    with pytest.raises(ValueError, match="Tried to step 6 times"):
        sim.scheduler.step([1.0, 1.0])  # the scheduler itself, as a DeepSpeed engine would call it


# ---- (g) probe fitness --------------------------------------------------------------------
def _probe_vs_train_run(fitness):
    """R = 2, spread 0.5, one sync at step 4 with auto-LR (log controller, automatic
    temperature, momentum 0.5, step 0.5). The training loss adds 10 nats on the high-LR
    replica (a constant: no effect on gradients), the probe adds 10 nats on the low-LR
    one, so the two fitnesses rank the replicas in opposite orders."""
    R, T = 2, 4
    data = make_data(T, R)
    g = torch.Generator().manual_seed(11)
    xp, yp = torch.randn(16, D_IN, generator=g), torch.randn(16, D_OUT, generator=g)
    calls = []
    holder = {}

    def high(r):
        lrs = [o.param_groups[0]["lr"] for o in holder["sim"].optimizers]
        return lrs[r] > lrs[1 - r]

    def loss_fn(t):
        def fn(model, r):
            return loss_for(data, t)(model, r) + (10.0 if high(r) else 0.0)
        return fn

    def probe_fn(model, r):
        loss = nn.functional.mse_loss(model(xp), yp) + (0.0 if high(r) else 10.0)
        calls.append({"r": r, "grad": torch.is_grad_enabled(), "loss": float(loss),
                      "weight": model.lin.weight.detach().clone()})
        return loss

    cfg = hdet(replicas=R, sync_interval=T, total_steps=12, spread=0.5, sharing="replica",
               auto={"enabled": True, "warmup_steps": 0, "fitness": fitness, "step_size": 0.5})
    sim = Simulator(lambda: Tiny(seed=2), sgd, cfg, probe_fn=probe_fn if fitness == "probe" else None)
    holder["sim"] = sim
    for t in range(T):
        sim.step(loss_fn(t))
    return sim, calls


def test_meta_update_follows_the_probe_not_the_training_loss():
    """By hand for R = 2 with the automatic temperature: the scores are exactly +1 and -1
    whatever the gap, so g = +-tanh(1) (the sign of the better replica's offset), v =
    0.5 g and log m = 0.5 v = +-tanh(1) / 4: up when the probe decides (it favours the
    high LR), down when the training loss does."""
    sim, calls = _probe_vs_train_run("probe")
    rec = sim.scheduler.last_sync
    assert rec["hdet/lr/group_0/multiplier"] == pytest.approx(math.exp(math.tanh(1.0) / 4), rel=1e-12)
    # the probe ran once per replica, under no_grad, before converge (the replicas still differed)
    assert [c["r"] for c in calls] == [0, 1] and not any(c["grad"] for c in calls)
    assert not torch.equal(calls[0]["weight"], calls[1]["weight"])
    for r in range(2):
        assert rec[f"hdet/fitness/replica_{r}"] == pytest.approx(calls[r]["loss"], rel=1e-6)  # float32 loss
    assert rec["hdet/loss/replica_0"] != rec["hdet/fitness/replica_0"]

    sim, calls = _probe_vs_train_run("train_loss")
    rec = sim.scheduler.last_sync
    assert calls == [] and not any(k.startswith("hdet/fitness/") for k in rec)
    assert rec["hdet/lr/group_0/multiplier"] == pytest.approx(math.exp(-math.tanh(1.0) / 4), rel=1e-12)


def test_probe_fitness_without_probe_fn_raises_at_construction():
    with pytest.raises(HDETConfigError, match="hdet.auto.fitness"):
        Simulator(Tiny, sgd, hdet(spread=0.2, auto={"enabled": True}))
    # train_loss fitness, or auto-LR off, needs no probe
    Simulator(Tiny, sgd, hdet(spread=0.2, auto={"enabled": True, "fitness": "train_loss"}))
    Simulator(Tiny, sgd, hdet(spread=0.2, auto={"enabled": False}))


# ---- (h) warm noisy initialisation ---------------------------------------------------------
class TwoScales(nn.Module):
    """Two 64x64 layers whose weights differ in scale by 100x and zero biases: the
    whole-model RMS convention gives every tensor the same noise std (a per-tensor RMS
    would give the biases none and the small layer 100x less)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(64, 64, generator=g) * 3.0)
            self.b.weight.copy_(torch.randn(64, 64, generator=g) * 0.03)
            self.a.bias.zero_()
            self.b.bias.zero_()
        self.bn = nn.BatchNorm1d(64, affine=False)  # buffers only: not noised

    def forward(self, x):
        return self.bn(self.b(self.a(x)))


_TEMPLATE = TwoScales()  # built once: the Simulator's model_fn below only deep-copies it


def _warm_sim(nu=0.01, seed=0, enabled=True, replicas=3):
    block = hdet(replicas=replicas, spread=0.2)
    block["warm_init"] = {"enabled": enabled, "nu": nu, "seed": seed}
    return Simulator(lambda: copy.deepcopy(_TEMPLATE), sgd, block)


def _noise(sim, r):
    return [(p.detach().double() - q.detach().double()) for p, q in zip(sim.models[r].parameters(),
                                                                         _TEMPLATE.parameters())]


def test_warm_init_noise_std_is_nu_times_whole_model_rms():
    """Noise std = nu * RMS over all 8320 parameters of the template (float64 by hand).
    The sample std of n i.i.d. N(0, s^2) draws has relative standard error
    ~1/sqrt(2n); the check allows 5 of them: 5.5% per 4096-weight tensor, 44% per
    64-bias tensor, 3.9% over the whole model; the mean within 5 s / sqrt(n)."""
    nu = 0.01
    flat = torch.cat([p.detach().double().flatten() for p in _TEMPLATE.parameters()])
    n = flat.numel()
    assert n == 2 * (64 * 64 + 64)
    s = nu * math.sqrt(float((flat ** 2).sum()) / n)
    sim = _warm_sim(nu=nu)
    for r in range(3):
        noise = _noise(sim, r)
        for t in noise:
            tol = 5 / math.sqrt(2 * t.numel())
            std = math.sqrt(float((t ** 2).mean()))
            assert abs(std / s - 1) < tol, (r, t.shape, std, s)
        allnoise = torch.cat([t.flatten() for t in noise])
        assert abs(math.sqrt(float((allnoise ** 2).mean())) / s - 1) < 5 / math.sqrt(2 * n)
        assert abs(float(allnoise.mean())) < 5 * s / math.sqrt(n)
        for k, v in sim.models[r].state_dict().items():  # buffers untouched
            if "running" in k or "num_batches" in k:
                assert torch.equal(v, _TEMPLATE.state_dict()[k]), k
    # the noise is independent across replicas: no two equal, nearly uncorrelated
    n0, n1 = (torch.cat([t.flatten() for t in _noise(sim, r)]) for r in (0, 1))
    assert not torch.equal(n0, n1)
    assert abs(float(torch.dot(n0, n1)) / (n * s * s)) < 5 / math.sqrt(n)


def test_warm_init_draws_are_the_documented_generator():
    """Replica r's noise is std * randn(shape) per parameter in order, from a float32
    generator seeded with noise_seed(seed, r, 0): the draws of a real full-copy rank."""
    from hdet_scale.warm_init import noise_seed

    nu, seed = 0.02, 5
    flat = torch.cat([p.detach().double().flatten() for p in _TEMPLATE.parameters()])
    s = nu * math.sqrt(float((flat ** 2).mean()))
    sim = _warm_sim(nu=nu, seed=seed, replicas=2)
    for r in range(2):
        gen = torch.Generator().manual_seed(noise_seed(seed, r, 0))
        for got, p in zip(_noise(sim, r), _TEMPLATE.parameters()):
            want = torch.randn(p.shape, generator=gen, dtype=torch.float32).double() * s
            # float32 rounding of p + noise: at most half an ulp of |p| + |noise| (< 1e-6 here)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_warm_init_reproducible_and_seed_dependent_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.random.get_rng_state().clone()
    a, b, c = _warm_sim(seed=4), _warm_sim(seed=4), _warm_sim(seed=5)
    assert torch.equal(before, torch.random.get_rng_state())
    for r in range(3):
        for pa, pb, pc in zip(a.models[r].parameters(), b.models[r].parameters(), c.models[r].parameters()):
            assert torch.equal(pa, pb)
        assert any(not torch.equal(pa, pc) for pa, pc in zip(a.models[r].parameters(), c.models[r].parameters()))


@pytest.mark.parametrize("nu,enabled", [(0.0, True), (0.05, False)])
def test_warm_init_off_or_nu_zero_leaves_replicas_identical(nu, enabled):
    sim = _warm_sim(nu=nu, enabled=enabled)
    for m in sim.models:
        for p, q in zip(m.parameters(), _TEMPLATE.parameters()):
            assert torch.equal(p, q)
    assert sim.scheduler.warm_init() is False


def test_warm_init_only_before_the_first_step():
    sim = _warm_sim(replicas=2)
    sim.step(lambda m, r: m(torch.ones(4, 64)).pow(2).mean())
    before = [params_of(m) for m in sim.models]
    assert sim.scheduler.warm_init() is False
    for m, ps in zip(sim.models, before):
        for p, q in zip(m.parameters(), ps):
            assert torch.equal(p, q)


# ---- (i) state_dict round trip with the log controller and probe fitness -----------------
def test_log_controller_state_dict_round_trip_continues_identically():
    """The default controller (log, probe fitness, tied groups) with warm init: stop
    mid-interval after two meta-updates, load into a fresh simulator (its own warm-init
    noise is overwritten by the state), continue: bit-identical losses, LRs, multipliers."""
    R, T, N, stop = 3, 3, 12, 7
    data = make_data(N, R)
    g = torch.Generator().manual_seed(3)
    xp, yp = torch.randn(16, D_IN, generator=g), torch.randn(16, D_OUT, generator=g)

    def probe_fn(model, r):
        return nn.functional.mse_loss(model(xp), yp)

    cfg = hdet(replicas=R, sync_interval=T, total_steps=N, spread=0.3, sharing="replica",
               auto={"enabled": True, "warmup_steps": 0})
    cfg["warm_init"] = {"enabled": True, "nu": 0.05, "seed": 1}
    a, b = _stop_save_load_continue(
        cfg, data, stop, N, R,
        lambda a: a.scheduler.controller.updates == 2 and a.scheduler.controller.log_m[("lr", 0)] != 0.0, probe_fn)
    assert a.scheduler.controller.log_m == b.scheduler.controller.log_m
    assert a.scheduler.velocity == b.scheduler.velocity and a.scheduler.controller.updates == 4
    assert a.scheduler.last_sync == {**b.scheduler.last_sync, "hdet/converge_s": a.scheduler.last_sync["hdet/converge_s"]}
    for ma, mb in zip(a.models, b.models):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(pa, pb)
