"""HDET on top of optimizers with more than one iterate (schedule-free AdamW), in the
Simulator: converge averages the optimizer's ``z`` and group scalars with the weights, the
probe and ``eval_mode`` use the evaluation point x, and one replica with no spread is
plain schedule-free training bit for bit. Also the per-example probe and the noise-aware
temperature (``hdet.auto.noise_scale``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

schedulefree = pytest.importorskip("schedulefree")

from hdet_scale import Simulator, iterates  # noqa: E402
from hdet_scale.controller import auto_temperature, fitness_noise, softmax_weights  # noqa: E402
from hdet_scale.errors import HDETConfigError  # noqa: E402
from hdet_scale.probe import probe_examples, probe_value  # noqa: E402

X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
BETA1 = 0.9


def model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def sf(params) -> torch.optim.Optimizer:
    groups = [{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() == 1],
                                                              "weight_decay": 0.0}]
    return schedulefree.AdamWScheduleFree(groups, lr=2e-2, betas=(BETA1, 0.99), weight_decay=0.01,
                                          warmup_steps=3, foreach=False)


def block(replicas: int = 2, spread: float = 0.3, auto: bool = True, steps: int = 20) -> dict:
    return {"replicas": replicas, "sync_interval": 5, "axes": {"lr": {"spread_ratio": spread}},
            "schedule": {"name": "constant", "total_steps": steps},
            "auto": {"enabled": auto, "warmup_steps": 5, "step_size": 0.5}}


def loss(m: torch.nn.Module, r: int) -> torch.Tensor:
    return F.mse_loss(m(X[32 * r:32 * (r + 1)]), Y[32 * r:32 * (r + 1)])


def per_example_probe(m: torch.nn.Module, r: int) -> torch.Tensor:
    return ((m(X) - Y) ** 2).mean(dim=1)


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def test_spec_by_class_name_subclass_or_declaration():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert iterates.spec_for(torch.optim.AdamW(p)) is None
    assert iterates.spec_for(schedulefree.SGDScheduleFree(p)).state_keys == ("z",)

    class Clipped(schedulefree.AdamWScheduleFree):  # a user's subclass keeps the base's spec
        pass

    assert iterates.has_modes(Clipped(p))

    class Mine(torch.optim.SGD):
        hdet_iterates = iterates.IterateSpec(state_keys=("avg",))

    assert iterates.spec_for(Mine(p, lr=0.1)).state_keys == ("avg",)


def sf_reference(params) -> torch.optim.Optimizer:  # keeps y and x as state too
    return schedulefree.AdamWScheduleFreeReference(params, lr=2e-2, betas=(BETA1, 0.99), weight_decay=0.01,
                                                   warmup_steps=3)


@pytest.mark.parametrize("make", [sf, sf_reference], ids=["AdamWScheduleFree", "AdamWScheduleFreeReference"])
def test_converge_averages_z_and_group_scalars_so_every_replica_has_the_same_x(make):
    """After each sync every replica holds the same y (the weights), the same iterate
    state (z; the reference form's x and y too) and weight_sum / lr_max, hence the same x.
    Teeth: between syncs the replicas' state differs (their LRs differ), and with it left
    out of the average (``state_tensors`` patched to return nothing, next test) the
    replicas' x differ after the same sync."""
    sim = Simulator(model, make, block(), probe_fn=per_example_probe)
    for step in range(1, 21):
        sim.step(loss)
        zs = [iterates.state_tensors(o) for o in sim.optimizers]
        scalars = [iterates.group_scalars(o) for o in sim.optimizers]
        same_z = all(torch.equal(a, b) for a, b in zip(*zs))
        if step % 5 == 0:
            assert same_z and scalars[0] == scalars[1]
            assert torch.equal(flat(sim.models[0]), flat(sim.models[1]))
            with sim.scheduler.eval_mode():
                assert torch.equal(flat(sim.models[0]), flat(sim.models[1]))
        else:
            assert not same_z and scalars[0] != scalars[1]
    assert sim.scheduler.last_sync["hdet/lr/group_0/multiplier"] != 1.0


def test_without_the_z_average_the_replicas_evaluate_apart(monkeypatch):
    monkeypatch.setattr(iterates, "state_tensors", lambda opt: [])
    sim = Simulator(model, sf, block(auto=False), probe_fn=None)
    for _ in range(5):
        sim.step(loss)
    assert torch.equal(flat(sim.models[0]), flat(sim.models[1]))  # y averaged
    with sim.scheduler.eval_mode():
        assert (flat(sim.models[0]) - flat(sim.models[1])).abs().max() > 1e-4  # x not


def test_eval_mode_holds_x_and_returns_to_y():
    """Inside: x = (y - (1 - beta1) z) / beta1 (schedule-free's relation; float32, rtol
    1e-5 for the division's amplification of y's rounding); after: y again, up to the two
    lerps' rounding (atol 1e-6 on weights of magnitude < 2)."""
    sim = Simulator(model, sf, block(replicas=1, spread=0.0, auto=False), probe_fn=None)
    for _ in range(7):
        sim.step(loss)
    opt = sim.optimizers[0]
    y = flat(sim.models[0]).clone()
    z = torch.cat([t.reshape(-1) for t in iterates.state_tensors(opt)])
    params = list(sim.models[0].parameters())
    order = {id(p): i for i, p in enumerate(params)}  # state_tensors runs in group order
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    grouped = [p for g in opt.param_groups for p in g["params"]]
    z_model = torch.empty_like(z)
    at = 0
    for p in grouped:
        i = order[id(p)]
        z_model[starts[i]:starts[i] + p.numel()] = z[at:at + p.numel()]
        at += p.numel()
    with sim.scheduler.eval_mode():
        assert not iterates.in_train_mode(opt)
        x = flat(sim.models[0])
        torch.testing.assert_close(x, (y - (1 - BETA1) * z_model) / BETA1, rtol=1e-5, atol=1e-6)
    assert iterates.in_train_mode(opt)
    torch.testing.assert_close(flat(sim.models[0]), y, rtol=0, atol=1e-6)
    assert (x - y).abs().max() > 1e-3


def test_one_replica_without_spread_is_plain_schedule_free_bit_for_bit():
    """R = 1, spread 0, auto-LR off, constant schedule: the Simulator sets each group's
    LR to its peak every step and converges a single replica (a mean of one): the same
    arithmetic as a plain loop with the same optimizer, so the weights and x agree
    exactly."""
    sim = Simulator(model, sf, block(replicas=1, spread=0.0, auto=False), probe_fn=None)
    m = model()
    opt = sf(list(m.parameters()))
    opt.train()
    for _ in range(20):
        sim.step(loss)
        opt.zero_grad(set_to_none=True)
        loss(m, 0).backward()
        opt.step()
    assert torch.equal(flat(sim.models[0]), flat(m))
    opt.eval()
    with sim.scheduler.eval_mode():
        assert torch.equal(flat(sim.models[0]), flat(m))


def test_fitness_noise_is_the_paired_standard_error():
    """Two replicas: e_0i = d_i / 2 with d_i the per-example gap, so the noise is
    sd(d) / (2 sqrt(N)), the standard error of the gap halved (each replica's distance
    from the mean)."""
    g = torch.Generator().manual_seed(3)
    base = torch.rand(50, generator=g) * 3  # the examples' own difficulty: cancels
    d = torch.randn(50, generator=g) * 0.01 + 0.002
    x = torch.stack([base + d, base]).double()
    gap = x[0] - x[1]  # d as the float32 sums left it
    assert fitness_noise(x) == pytest.approx(float(gap.std()) / (2 * math.sqrt(50)), rel=1e-12)
    assert fitness_noise(torch.tensor([[1.0, float("nan")], [1.0, 2.0], [0.5, 2.5]])) is not None  # NaN row left out
    assert fitness_noise(torch.ones(1, 5)) is None and fitness_noise(torch.ones(2, 1)) is None


def test_a_gap_inside_the_noise_barely_moves_the_weights():
    """R = 2: z-scores alone give weights 0.88 / 0.12 whatever the gap; with the noise
    (scale 3) replicas one noise unit from their mean (gap 2 units) get 0.65 / 0.35, and
    20 units from it nearly the z-score weights."""
    se = 0.01
    for gap, lo, hi in ((2 * se, 0.5, 0.66), (40 * se, 0.86, 0.881)):
        losses = [1.0, 1.0 + gap]
        w = softmax_weights(losses, auto_temperature(losses, se, 3.0)).weights
        assert lo < w[0] < hi, (gap, w)
        assert softmax_weights(losses, auto_temperature(losses)).weights[0] == pytest.approx(0.8808, abs=1e-4)
    assert auto_temperature([1.0, 2.0], None, 3.0) == auto_temperature([1.0, 2.0], 0.5, 0.0) == 0.5


def test_probe_results():
    assert probe_value(torch.tensor([1.0, 2.0, 3.0])) == 2.0
    assert probe_examples(torch.tensor(2.0)) is None and probe_examples(1.5) is None
    assert probe_examples(torch.tensor([1.0, 3.0])).dtype == torch.float64
    with pytest.raises(HDETConfigError, match=r"per-example losses \(a 1-D tensor\)"):
        probe_value(torch.ones(2, 2))


def test_simulator_records_the_fitness_noise_and_widens_the_temperature():
    sim = Simulator(model, sf, block(), probe_fn=per_example_probe)
    for _ in range(10):
        sim.step(loss)
    rec = sim.scheduler.last_sync
    fit = [rec[f"hdet/fitness/replica_{r}"] for r in range(2)]
    assert rec["hdet/fitness_noise"] > 0
    assert rec["hdet/temperature"] == pytest.approx(math.hypot(abs(fit[0] - fit[1]) / 2, 3 * rec["hdet/fitness_noise"]),
                                                    rel=1e-12)


def test_ensemble_eval_moves_to_x_and_refuses_a_step_or_checkpoint_until_train(tmp_path):
    """``Ensemble.eval()`` enters the scheduler's eval mode (x), ``train()`` leaves it;
    in between a step or a checkpoint is refused (``HDETStateError``) before anything
    moves. A Simulator of one replica stands for the engine (the same scheduler calls)."""
    from hdet_scale.api import Ensemble
    from hdet_scale.errors import HDETStateError

    sim = Simulator(model, sf, block(replicas=1, spread=0.0, auto=False), probe_fn=None)
    for _ in range(6):
        sim.step(loss)
    m, opt = sim.models[0], sim.optimizers[0]
    ens = Ensemble("ddp", m, opt, sim.scheduler, grad_accum=1, clip=0.0)
    y = flat(m).clone()
    ens.eval()
    assert not m.training and not iterates.in_train_mode(opt)
    x = flat(m).clone()
    assert (x - y).abs().max() > 1e-3
    with pytest.raises(HDETStateError, match=r"Ensemble.save_checkpoint: .*call ens.train\(\) first"):
        ens.save_checkpoint(str(tmp_path / "ckpt"))
    ens.backward(loss(m, 0))
    with pytest.raises(HDETStateError, match=r"Ensemble.step: the parameters hold the optimizer's evaluation point"):
        ens.step()
    assert torch.equal(flat(m), x) and not (tmp_path / "ckpt").exists()
    ens.train()
    assert m.training and iterates.in_train_mode(opt)
    torch.testing.assert_close(flat(m), y, rtol=0, atol=1e-6)
