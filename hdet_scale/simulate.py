"""Single-process simulator of HDET: R replicas of one model in one process, one device.

What it is for:

- Trying HDET (spread, sync interval, auto-LR, gradient-sharing mode) on one GPU, or on
  the CPU, before booking a cluster: the hyperparameter logic is *the same code* as on
  real ranks. :class:`Simulator` drives the same :class:`~hdet_scale.ensemble.HDETScheduler`
  (config, axes, controller, schedules) as the DeepSpeed backend; only the communication
  object differs (:class:`SimulatedSync` instead of
  :class:`~hdet_scale.sync.DistributedSync`).
- The oracle of the distributed tests: an ``R x S`` run on real ranks should match the
  simulator with R replicas, each replica's loss being the mean over its S shard ranks'
  data (up to the summation order of the all-reduces, see below).

Method: Cheng, Huang, Zhu, Alonso, "Scalable Hyperparameter-Divergent Ensemble Training
with Automatic Learning Rate Exploration for Large Models", arXiv 2604.24708.

Memory cost: R full copies of the model and R optimizer states, all on one device. With
fp32 Adam(W) that is about ``R x (params + grads + 2 moments) = R x 4 x P x 4`` bytes for
P parameters (e.g. R = 4, P = 125M: ~8 GB), plus R sets of activations one at a time
(replicas run forward/backward one after another, so activations are not multiplied).

Semantics of one :meth:`Simulator.step`:

1. For every replica r in order: ``loss_r = loss_fn(model_r, r)``, ``loss_r.backward()``
   (gradients were zeroed first). ``loss_r`` stands for the replica's loss over its
   whole batch, i.e. the mean over the S shard ranks of a real replica group.
2. ``gradient_sharing == "global"`` (paper Sec. 3.1): every parameter's gradient is
   replaced on every replica by the mean over the R replicas, as the real all-reduce
   over the replica group does (sum in replica order, then divide by R; a real
   all-reduce may sum in another order, so results agree only up to float rounding).
   ``"replica"``: each replica keeps its own gradient.
3. Every replica's optimizer steps with its own hyperparameters (set by the scheduler).
4. ``scheduler.step([loss_0, ..., loss_{R-1}])``: accumulate the losses, converge every
   ``sync_interval`` steps (average parameters and persistent floating buffers over the
   replicas with a finite interval loss), meta-update after the auto-LR warm-up, then
   set the next step's values.

The global RNG is never touched by the simulator itself (``model_fn`` and ``loss_fn``
may use it; the scheduler's permutations come from its own seeded generator).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from hdet_scale import iterates
from hdet_scale import warm_init as wi
from hdet_scale.averaging import accumulate_dtype, persistent_float_buffers
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups
from hdet_scale.controller import fitness_noise
from hdet_scale.probe import probe_examples, probe_value, require_probe

__all__ = ["SimulatedSync", "Simulator"]


def _converge_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + persistent_float_buffers(model)


@torch.no_grad()
def _mean_into_all(tensors: Sequence[torch.Tensor], keep: Sequence[bool]) -> None:
    """Write the mean of ``tensors[r]`` over the r with ``keep[r]`` into every tensor.

    Sum in replica order in float32 (float64 stays float64), then divide by the number of
    contributors, then cast back: the arithmetic of ``averaging.mean_all_reduce_``, whose
    bucketing (slices, in place or streamed) is element-wise and does not change it."""
    n = sum(keep)
    acc = None
    for t, k in zip(tensors, keep):
        if not k:
            continue
        x = t.to(accumulate_dtype(t.dtype))
        acc = x.clone() if acc is None else acc.add_(x)
    acc.div_(n)
    for t in tensors:
        t.copy_(acc)


class SimulatedSync:
    """The scheduler's ``Sync`` protocol for R replicas held by this process.

    Args:
        models: the R replicas (same architecture: same parameter and buffer shapes and
            order).
        optimizers: their optimizers (length R); gradient sharing averages the
            gradients of the parameters in their param groups.
        gradient_sharing: ``"global"`` or ``"replica"`` (as ``hdet.gradient_sharing``).
            The sync itself shares nothing on its own: :class:`Simulator` calls
            :meth:`share_gradients` between backward and the optimizer steps when the
            mode is ``"global"``.

    Raises:
        ValueError: lengths differ, no replica, an unknown ``gradient_sharing``, or the
            replicas' parameters / buffers differ in number, shape or dtype.
    """

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 gradient_sharing: str) -> None:
        if len(models) == 0 or len(models) != len(optimizers):
            raise ValueError(f"need one optimizer per model and at least one model, got {len(models)} models "
                             f"and {len(optimizers)} optimizers")
        if gradient_sharing not in ("global", "replica"):
            raise ValueError(f"gradient_sharing must be 'global' or 'replica', got {gradient_sharing!r}")
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.gradient_sharing = gradient_sharing
        self.replicas = len(self.models)
        self.local_replicas = list(range(self.replicas))
        ref = [(t.shape, t.dtype) for t in _converge_tensors(self.models[0])]
        for r, m in enumerate(self.models[1:], start=1):
            mine = [(t.shape, t.dtype) for t in _converge_tensors(m)]
            if mine != ref:
                raise ValueError(f"replica {r} has different parameters/buffers (shapes or dtypes) than replica 0")
        self._sum: list[torch.Tensor | float] = [0.0] * self.replicas
        self._count = [0] * self.replicas
        self.probe_noise: float | None = None  # of the last probe_losses (controller.fitness_noise)

    # ---- losses -------------------------------------------------------------------------
    def add_loss(self, loss: Sequence[Any]) -> None:
        """Record one step's losses: a sequence of R floats or 0-dim (or 1-element)
        tensors, nats. Summed per replica in float64, kept on the tensors' device.

        Raises:
            ValueError: not R values.
        """
        if isinstance(loss, torch.Tensor) and loss.dim() == 1:
            loss = list(loss.unbind(0))
        if isinstance(loss, (str, bytes)) or not isinstance(loss, Sequence) or len(loss) != self.replicas:
            raise ValueError(f"SimulatedSync.add_loss: expected a sequence of {self.replicas} losses "
                             f"(one per replica), got {loss!r}")
        for r, x in enumerate(loss):
            if isinstance(x, torch.Tensor):
                x = x.detach().reshape(()).to(torch.float64)
            else:
                x = float(x)
            self._sum[r] = self._sum[r] + x
            self._count[r] += 1

    def interval_losses(self, step: int | None = None) -> tuple[list[float], list[int]]:
        """Per-replica mean loss since the last call (sum / count, NaN for a replica that
        recorded none) and the counts; resets the accumulators. ``step`` is accepted for
        the ``Sync`` protocol: one process drives every replica, so they cannot be at
        different steps."""
        sums = [float(s) for s in self._sum]
        counts = list(self._count)
        self._sum = [0.0] * self.replicas
        self._count = [0] * self.replicas
        return [s / c if c > 0 else float("nan") for s, c in zip(sums, counts)], counts

    def probe_losses(self, probe: Callable[[nn.Module, int], Any]) -> list[float]:
        """Fitness of every replica: ``probe(model_r, r)`` (a scalar tensor or float,
        nats, or a 1-D tensor of per-example losses whose mean is the fitness and whose
        spread sets ``probe_noise``) under ``torch.no_grad``, for r = 0 .. R-1. It must score every replica on
        the same batches; on real ranks that is the mean over the replica's S shard ranks
        of their probe slices (``DistributedSync.probe_losses``)."""
        raw = []
        for r, (model, opt) in enumerate(zip(self.models, self.optimizers)):
            with torch.no_grad(), iterates.eval_mode(opt):  # schedule-free: score the evaluated point x
                raw.append(probe(model, r))
        examples = [probe_examples(x) for x in raw]
        same = all(e is not None for e in examples) and len({e.numel() for e in examples}) == 1
        self.probe_noise = fitness_noise(torch.stack(examples)) if same else None
        return [probe_value(x) for x in raw]

    def has_eval_point(self) -> bool:
        """The optimizers have train / eval modes (:mod:`hdet_scale.iterates`)."""
        return iterates.has_modes(self.optimizers[0])

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Every replica at its optimizer's evaluation point inside
        (:func:`hdet_scale.iterates.eval_mode`); nothing for one-iterate optimizers."""
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                stack.enter_context(iterates.eval_mode(opt))
            yield

    @torch.no_grad()
    def add_noise(self, nu: float, seed: int) -> None:
        """Warm noisy initialisation (:mod:`hdet_scale.warm_init`): replica r adds
        ``N(0, (nu * RMS)^2)`` to its floating parameters, in ``parameters()`` order, from
        a generator seeded with ``noise_seed(seed, r, 0)``: the draws of a real rank that
        holds the full model (DDP, S = 1)."""
        for r, model in enumerate(self.models):
            params = [p for p in model.parameters() if p.is_floating_point()]
            sumsq, count = wi.sum_of_squares(params)
            gen = torch.Generator().manual_seed(wi.noise_seed(seed, r, 0))
            wi.add_noise_(params, nu * (sumsq / count) ** 0.5, gen)

    # ---- averaging ----------------------------------------------------------------------
    @torch.no_grad()
    def share_gradients(self) -> None:
        """Replace every optimizer parameter's ``.grad`` on every replica by the mean over
        the R replicas (sum in replica order, then divide by R). A ``None`` gradient
        counts as zeros when another replica has one (as a flat gradient partition
        would); a parameter with no gradient anywhere is left alone."""
        if self.replicas == 1:
            return
        per_replica = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]
        for params in zip(*per_replica):
            if all(p.grad is None for p in params):
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            _mean_into_all([p.grad for p in params], [True] * self.replicas)

    @torch.no_grad()
    def converge(self, finite: list[bool]) -> None:
        """Average every parameter and persistent floating buffer over the replicas with
        ``finite[r]`` (all of them if none is finite) and write the mean into every
        replica, so the next forward pass uses it. An optimizer with more than one
        iterate (schedule-free's ``z``: :mod:`hdet_scale.iterates`) has those state
        tensors and its group scalars averaged the same way.

        The mean is a sum in replica order (fp16/bf16 accumulated in float32), then a
        division by the number of contributors: the arithmetic of
        ``averaging.mean_all_reduce_`` except that a real all-reduce may sum in another
        order (ring / tree), so the two agree up to float rounding.

        Raises:
            ValueError: ``finite`` does not have R entries.
        """
        if len(finite) != self.replicas:
            raise ValueError(f"converge: expected {self.replicas} flags, got {len(finite)}")
        keep = list(finite) if any(finite) else [True] * self.replicas
        per_replica = [_converge_tensors(m) + iterates.state_tensors(o) for m, o in zip(self.models, self.optimizers)]
        for tensors in zip(*per_replica):
            _mean_into_all(tensors, keep)
        scalars = [torch.tensor(iterates.group_scalars(o), dtype=torch.float64) for o in self.optimizers]
        if scalars[0].numel():
            _mean_into_all(scalars, keep)
            for o, t in zip(self.optimizers, scalars):
                iterates.set_group_scalars(o, t.tolist())

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"loss_sum": [R floats], "loss_count": [R ints]}`` (float64 sums, exact)."""
        return {"loss_sum": [float(s) for s in self._sum], "loss_count": list(self._count)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Raises ValueError for a different R."""
        sums, counts = list(state["loss_sum"]), list(state["loss_count"])
        if len(sums) != self.replicas or len(counts) != self.replicas:
            raise ValueError(f"SimulatedSync state has {len(sums)} replicas, this simulator {self.replicas}")
        self._sum = [float(s) for s in sums]
        self._count = [int(c) for c in counts]


class Simulator:
    """R HDET replicas of one model in this process (see the module docstring).

    Args:
        model_fn: ``() -> nn.Module``, called R times; replica 0's ``state_dict`` is then
            loaded into every other replica, so all start identical. Put the model on
            the device you want inside ``model_fn``.
        optimizer_fn: ``(params) -> Optimizer``, called once per replica with
            ``list(model_r.parameters())``. Its ``lr`` is the peak LR when
            ``hdet.schedule.max_lr`` is null. Every optimizer must have the same number
            of parameter groups. A schedule-free optimizer (:mod:`hdet_scale.iterates`)
            is put in train mode here; the probe runs in its eval mode, and converge
            averages its ``z`` too. Evaluate or save a replica inside
            ``iterates.eval_mode(optimizers[r])``.
        config: an :class:`HDETConfig` or an ``"hdet"`` block (dict, parsed with
            :meth:`HDETConfig.from_dict`). ``replicas`` is R.
        probe_fn: ``(model_r, r) -> loss`` on fixed probe batches, the same for every r
            (run under ``torch.no_grad``; switch dropout off inside it if the model has
            any); needed when ``auto.fitness`` is ``"probe"`` and auto-LR is enabled.
            With ``warm_init.enabled``, each replica's noise is added after the copy of
            replica 0's weights.

    Attributes:
        models, optimizers: lists of length R.
        sync: the :class:`SimulatedSync`.
        scheduler: the :class:`HDETScheduler` (``step_count``, ``last_sync``,
            ``replica_values(axis, group)``, ...).

    Raises:
        HDETConfigError: an invalid config (from ``HDETConfig.from_dict`` or the
            scheduler), or a probe fitness without ``probe_fn``.
        ValueError: optimizers with different numbers of parameter groups, or replicas
            with different parameter shapes.
    """

    def __init__(self, model_fn: Callable[[], nn.Module],
                 optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 config: HDETConfig | Mapping[str, Any],
                 probe_fn: Callable[[nn.Module, int], torch.Tensor] | None = None) -> None:
        self.config = config if isinstance(config, HDETConfig) else HDETConfig.from_dict(config)
        R = self.config.replicas
        self.models = [model_fn() for _ in range(R)]
        state0 = self.models[0].state_dict()
        for m in self.models[1:]:
            m.load_state_dict(state0)
        self.optimizers = [optimizer_fn(list(m.parameters())) for m in self.models]
        for opt in self.optimizers:
            iterates.train_mode_(opt)  # schedule-free optimizers start in eval mode
        msg = iterates.schedule_warning(self.optimizers[0], self.config.schedule.name)
        if msg:
            warnings.warn(msg, UserWarning, stacklevel=2)
        ngroups = {len(o.param_groups) for o in self.optimizers}
        if len(ngroups) != 1:
            raise ValueError(f"optimizer_fn returned optimizers with different numbers of parameter groups: "
                             f"{[len(o.param_groups) for o in self.optimizers]}")
        self.sync = SimulatedSync(self.models, self.optimizers, self.config.gradient_sharing)
        self.scheduler = HDETScheduler(self.config, LiveParamGroups(dict(enumerate(self.optimizers))))
        self.scheduler.attach(self.sync)
        for r, m in enumerate(self.models):
            self.scheduler.bind_model(m, replica=r)  # model-side axes: replica r's values reach model r
        require_probe(self.config, probe_fn, "probe_fn", "probe_fn(model, r) -> loss", 2)
        self.scheduler.set_probe(probe_fn)
        self.scheduler.warm_init()

    @property
    def replicas(self) -> int:
        return len(self.models)

    def step(self, loss_fn: Callable[[nn.Module, int], torch.Tensor]) -> list[torch.Tensor]:
        """One optimizer step of every replica (module docstring, steps 1-4).

        Args:
            loss_fn: ``(model_r, r) -> loss``, a scalar tensor (nats): replica r's loss
                on its batch for this step. Called once per replica, r = 0 .. R-1.

        Returns:
            The R losses, detached (same dtype and device as returned by ``loss_fn``).

        Raises:
            ValueError: ``loss_fn`` returned something other than a one-element tensor, or
                the step would pass ``schedule.total_steps`` (checked before any replica
                steps).
        """
        self.scheduler.check_can_step()
        losses = []
        for r, (model, opt) in enumerate(zip(self.models, self.optimizers)):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, r)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"loss_fn must return a scalar tensor; replica {r} returned {loss!r}")
            loss.backward()
            losses.append(loss.detach().reshape(()))
        if self.config.gradient_sharing == "global":
            self.sync.share_gradients()
        for opt in self.optimizers:
            opt.step()
        self.scheduler.step(losses)
        return losses

    def converge(self) -> None:
        """Average the replicas now (no meta-update, no new permutation, interval losses
        untouched): e.g. to end a run with one model, ``models[0]``."""
        self.scheduler.converge()

    def state_dict(self) -> dict[str, Any]:
        """``{"models": [R state_dicts], "optimizers": [R state_dicts], "scheduler": ...}``
        (the scheduler's includes the sync's loss accumulators). Continuing from it is
        exact: resuming mid-interval gives the same values as not stopping."""
        return {"models": [m.state_dict() for m in self.models],
                "optimizers": [o.state_dict() for o in self.optimizers],
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (models, optimizers, then the scheduler,
        which re-applies the current hyperparameter values).

        Raises:
            ValueError: the state holds a different number of replicas.
            HDETStateError: from the scheduler (different R, sync interval or axes).
        """
        for key in ("models", "optimizers"):
            if len(state[key]) != self.replicas:
                raise ValueError(f"state has {len(state[key])} {key}, this simulator {self.replicas} replicas")
        for m, s in zip(self.models, state["models"]):
            m.load_state_dict(s)
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)
        self.scheduler.load_state_dict(state["scheduler"])
