"""Step agreement and the missing-loss rule, in one process.

- ``check_steps``: the verdict every rank reaches from the interval-loss all-reduce (the
  multi-rank side is tests/distributed/test_step_agreement.py).
- Auto-LR scored by the training loss with no loss passed fails at the first sync, before
  converge touches the replicas, not at the first meta-update after warm-up; the probe
  fitness needs no loss. Driven through the simulator's replicas, with an independent run
  that passes the loss as the comparison.
"""

from __future__ import annotations

import pytest
import torch

from hdet_scale import Simulator
from hdet_scale.errors import HDETConfigError, HDETStateError, HDETStepMismatchError
from hdet_scale.sync import check_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # derived-decay notes of short auto-LR runs


def test_check_steps_names_each_step_and_its_ranks():
    check_steps([5, 5, 5, 5])
    with pytest.raises(HDETStepMismatchError, match="step 6: rank 0; step 9: ranks 1, 2, 3") as e:
        check_steps([6, 9, 9, 9])
    assert isinstance(e.value, HDETStateError)
    for cause in ("another checkpoint", "skipped an optimizer step", "scheduler.step"):
        assert cause in str(e.value)
    with pytest.raises(HDETStepMismatchError, match="step 1: ranks 0, 2; step 2: ranks 1, 3"):
        check_steps([1, 2, 1, 2])


def _simulator(fitness: str) -> Simulator:
    cfg = {"replicas": 2, "sync_interval": 2, "gradient_sharing": "replica",
           "axes": {"lr": {"spread_ratio": 0.5}}, "schedule": {"name": "constant", "total_steps": 20},
           "auto": {"enabled": True, "warmup_steps": 6, "fitness": fitness}}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def model_fn() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)

    return Simulator(model_fn, lambda p: torch.optim.SGD(p, lr=0.1), cfg,
                     probe_fn=(lambda m, r: m(x).pow(2).mean()) if fitness == "probe" else None)


def _train(sim: Simulator, step: int, pass_loss: bool) -> None:
    """One optimizer step of every replica by hand (``Simulator.step`` always passes the
    losses), then ``scheduler.step`` with or without them."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    losses = []
    for m, opt in zip(sim.models, sim.optimizers):
        opt.zero_grad()
        loss = (m(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    sim.scheduler.step(losses if pass_loss else None)


def _weights(sim: Simulator) -> list[torch.Tensor]:
    return [torch.cat([p.detach().flatten().clone() for p in m.parameters()]) for m in sim.models]


def test_no_training_loss_fails_at_first_sync_before_converge():
    """First meta-update at step 6; the error comes at the first sync (step 2), with the
    replicas' weights left as the step's updates made them (not averaged). The same run
    passing its losses syncs at step 2 (replicas averaged) and goes on past step 6."""
    sim = _simulator("train_loss")
    _train(sim, 1, pass_loss=False)
    with pytest.raises(HDETConfigError, match="no rank recorded one in the interval ending at step 2"):
        _train(sim, 2, pass_loss=False)
    w = _weights(sim)
    assert sim.scheduler.sync_count == 0
    assert not torch.equal(w[0], w[1]), "converge ran before the error"

    ref = _simulator("train_loss")
    for step in (1, 2):
        _train(ref, step, pass_loss=True)
    r = _weights(ref)
    assert ref.scheduler.sync_count == 1 and torch.equal(r[0], r[1])
    # Before converge, the failing run's replicas are where the reference's were: its
    # converge of step 2 averages exactly these. Exact: the float32 sum of two values is
    # rounded once and halving is exact, as in the simulator's mean.
    assert torch.equal((w[0] + w[1]) / 2, r[0])
    for step in range(3, 8):
        _train(ref, step, pass_loss=True)
    assert ref.scheduler.auto_active


def test_probe_fitness_needs_no_training_loss():
    sim = _simulator("probe")
    for step in range(1, 8):
        _train(sim, step, pass_loss=False)
    assert sim.scheduler.sync_count == 3 and sim.scheduler.auto_active
