"""The HDET orchestrator: ``step(loss)`` -> accumulate, schedule, converge, meta-update.

``HDETScheduler`` is what the training loop sees. It behaves like a torch LR scheduler
(``step``, ``get_last_lr``, ``state_dict``) and is handed to ``deepspeed.initialize`` as
``lr_scheduler``, so ``engine.step(lr_kwargs={"loss": loss})`` drives it (DeepSpeed skips
it on fp16-overflow steps: the schedule position counts applied optimizer steps only).

Communication is delegated to a *sync* object (``DistributedSync`` for real ranks,
the simulator's for R replicas in one process); the arithmetic here is the same for all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch

from hdet_scale import axes as ax
from hdet_scale import controller as ctl
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.schedules import Constant, Cosine, OneCycle, Schedule

STATE_VERSION = 1


class Sync(Protocol):
    """Communication needed by the scheduler (see ``hdet_scale.sync``)."""

    replicas: int
    local_replicas: list[int]  # replica indices whose param groups this process sets

    def add_loss(self, loss: Any) -> None: ...
    def interval_losses(self) -> tuple[list[float], list[int]]: ...  # collective; resets
    def converge(self, finite: list[bool]) -> None: ...  # collective
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class LiveParamGroups(Mapping):
    """``{replica_index: optimizer.param_groups}`` read at every access.

    ``Optimizer.load_state_dict`` (also inside DeepSpeed's ``engine.load_checkpoint``)
    rebinds ``param_groups`` to new dicts: a list stored at start-up would go stale and
    the scheduler would set hyperparameters the optimizer no longer reads.

    Args:
        optimizers: ``{replica_index: optimizer}`` for the replicas this process drives.
    """

    def __init__(self, optimizers: Mapping[int, Any]) -> None:
        self._optimizers = dict(optimizers)

    def __getitem__(self, key: int) -> list[dict]:
        return self._optimizers[key].param_groups

    def __iter__(self) -> Iterator[int]:
        return iter(self._optimizers)

    def __len__(self) -> int:
        return len(self._optimizers)


def build_schedule(cfg: HDETConfig) -> Schedule:
    s = cfg.schedule
    if s.name == "onecycle":
        return OneCycle(s.total_steps, s.pct_start, s.anneal_strategy, s.div_factor, s.final_div_factor,
                        s.three_phase, s.base_momentum, s.max_momentum)
    if s.name == "cosine":
        return Cosine(s.total_steps, s.warmup_steps, s.min_ratio)
    return Constant(s.total_steps, s.warmup_steps)


def decay_for(cfg: HDETConfig, schedule: Schedule, axis: str, peak: float) -> float:
    """gamma of one explored (axis, group): ``hdet.auto.decay`` if given, else derived
    (``controller.derive_decay``) so that the LR base reaches the schedule's floor at the
    last sync. Axes without a schedule keep their level (gamma 0).

    The first meta-update runs at the first sync at or after ``auto.warmup_steps``
    (step ``first``), and K counts the syncs from there to ``total_steps`` inclusive.

    Raises:
        HDETConfigError: a derived gamma outside [0, 1).
    """
    auto = cfg.auto
    if not (auto.enabled and cfg.axis_auto(axis)):
        return 0.0
    if not isinstance(auto.decay, str):
        return float(auto.decay)
    if axis != "lr":
        return 0.0
    T, total = cfg.sync_interval, cfg.schedule.total_steps
    first = max(math.ceil(auto.warmup_steps / T), 1) * T
    k_syncs = (total - first) // T + 1 if first <= total else 0
    return ctl.derive_decay(schedule.value(min(first, total), peak), schedule.floor(peak), k_syncs)


def check_config(cfg: HDETConfig) -> None:
    """Checks that need the schedule (the derived decay) without an optimizer: the
    ratio floor/start does not depend on the peak, so peak 1.0 stands for every group.
    Pure; raises HDETConfigError."""
    schedule = build_schedule(cfg)
    for axis in cfg.axes:
        decay_for(cfg, schedule, axis, 1.0)


class HDETScheduler:
    """Sets every replica's hyperparameters each optimizer step and runs the sync.

    Args:
        config: parsed ``"hdet"`` block.
        param_groups: ``{replica_index: optimizer.param_groups}`` for the replicas this
            process drives (one entry on a real rank; R in the simulator). Groups must
            have ``"lr"`` (and ``"weight_decay"`` when that axis is explored).
        sync: communication object; may be attached later with :meth:`attach`.
        logger: optional :class:`~hdet_scale.logging.MetricsLogger` (enabled on global
            rank 0 only): a record at every sync, and every ``logging.every`` steps the
            step's loss (this rank's) and every replica's values, merged with
            ``self.extra`` (e.g. the trainer's tokens/s).

    Units: ``step`` counts optimizer steps (never micro-batches); ``sync_interval`` and
    ``auto.warmup_steps`` likewise. Raises HDETConfigError for a parameter-group index
    out of range, a missing hyperparameter, or a derived decay outside [0, 1).
    """

    def __init__(self, config: HDETConfig, param_groups: dict[int, list[dict]], sync: Sync | None = None,
                 logger: Any = None) -> None:
        self.config = config
        self.replicas = config.replicas
        self.param_groups = param_groups
        self.schedule = build_schedule(config)
        self.total_steps = config.schedule.total_steps
        self.sync_obj = sync
        self.logger = logger
        self.extra: dict[str, Any] = {}
        groups = next(iter(param_groups.values()))
        self.check_param_groups(config, groups)
        self.num_groups = len(groups)
        self.peaks = self._peaks(groups)
        self.explored = self._explored()  # (axis, group) pairs in hdet.axes
        self.initial = {(a, g): float(groups[g][a]) for a in config.axes for g in range(self.num_groups)}
        self.applied: dict[tuple[str, int], list[float]] = {}  # values of the current step
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step_count = 0
        self.sync_count = 0
        self.base: dict[tuple[str, int], float] = {}  # meta-updated base values, once auto-LR runs
        self.velocity = {k: 0.0 for k in self.explored}
        self.decay = self._decays()
        self.permutations = {k: ax.draw_permutation(self.generator, self.replicas) for k in self.explored}
        self.last_sync: dict[str, Any] = {}
        self._apply()

    # ---- set-up -------------------------------------------------------------------------
    @staticmethod
    def check_param_groups(config: HDETConfig, groups: list[dict]) -> None:
        """The checks of ``config`` against an optimizer's param groups, without building
        anything (so a backend runs them before its first collective): every explored
        group index exists and holds the explored hyperparameter, and a ``max_lr`` list
        has one value per group. Raises HDETConfigError naming the key."""
        m = config.schedule.max_lr
        if isinstance(m, list) and len(m) != len(groups):
            raise HDETConfigError(f"hdet.schedule.max_lr: {len(m)} values for {len(groups)} parameter groups")
        for name, axis in sorted(config.axes.items()):
            for g in axis.groups or []:
                if g >= len(groups):
                    raise HDETConfigError(f"hdet.axes.{name}.groups: group {g} does not exist "
                                          f"(the optimizer has {len(groups)} parameter groups)")
            for g, grp in enumerate(groups):
                if name not in grp:
                    raise HDETConfigError(f"hdet.axes.{name}: parameter group {g} has no '{name}' "
                                          f"(keys: {sorted(k for k in grp if k != 'params')})")

    def _peaks(self, groups: list[dict]) -> list[float]:
        m = self.config.schedule.max_lr
        if m is None:
            return [float(g["lr"]) for g in groups]
        if isinstance(m, list):
            return [float(v) for v in m]
        return [float(m)] * len(groups)

    def _explored(self) -> list[tuple[str, int]]:
        out = []
        for name in sorted(self.config.axes):
            axis = self.config.axes[name]
            groups = range(self.num_groups) if axis.groups is None else axis.groups
            out.extend((name, g) for g in groups)
        return out

    def _decays(self) -> dict[tuple[str, int], float]:
        return {(a, g): decay_for(self.config, self.schedule, a, self.peaks[g]) for a, g in self.explored}

    def attach(self, sync: Sync) -> None:
        self.sync_obj = sync

    @property
    def topology(self) -> Any:
        """The attached sync's :class:`~hdet_scale.topology.Topology` (``None`` in the
        simulator)."""
        return getattr(self.sync_obj, "topology", None)

    # ---- values -------------------------------------------------------------------------
    @property
    def auto_active(self) -> bool:
        """True once the first meta-update has run (base values piecewise constant)."""
        return bool(self.base)

    def base_value(self, axis: str, group: int) -> float:
        """The shared (un-spread) value of ``axis`` for ``group`` at the current step."""
        if (axis, group) in self.base:
            return self.base[(axis, group)]
        if axis == "lr":
            return self.schedule.value(min(self.step_count, self.total_steps), self.peaks[group])
        return self.initial[(axis, group)]

    def replica_values(self, axis: str, group: int) -> list[float]:
        """Value of ``axis`` for ``group`` on each of the R replicas at the current step."""
        base = self.base_value(axis, group)
        if (axis, group) not in self.permutations:
            return [base] * self.replicas
        a = self.config.axes[axis]
        return ax.replica_values(base, a.kind, a.spread_ratio, self.permutations[(axis, group)])

    def _apply(self) -> None:
        cyc = self.config.schedule.cycle_momentum
        beta1 = self.schedule.momentum(min(self.step_count, self.total_steps)) if cyc else None
        for axis in self.config.axes:
            for g in range(self.num_groups):
                values = self.replica_values(axis, g)
                self.applied[(axis, g)] = values
                for r, groups in self.param_groups.items():
                    groups[g][axis] = values[r]
        if beta1 is not None:
            for groups in self.param_groups.values():
                for grp in groups:
                    if "betas" in grp:
                        grp["betas"] = (beta1, *grp["betas"][1:])
                    elif "momentum" in grp:
                        grp["momentum"] = beta1

    def get_last_lr(self) -> list[float]:
        """LR per parameter group of the first replica this process drives."""
        return [g["lr"] for g in next(iter(self.param_groups.values()))]

    # ---- step and sync ------------------------------------------------------------------
    def step(self, loss: Any = None, **_: Any) -> None:
        """Close one optimizer step: record its loss, sync every ``sync_interval`` steps,
        then set the values for the next step.

        Args:
            loss: the step's training loss on this rank (0-dim tensor or float, nats);
                in the simulator, a sequence of R losses. ``None`` records nothing; the
                auto-LR controller then raises at the first meta-update.

        Raises:
            ValueError: a step past ``schedule.total_steps`` (as ``OneCycleLR``), before
                any state change or collective.
        """
        self.check_can_step()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if loss is not None:
            self.sync_obj.add_loss(loss)
        self.step_count += 1
        if self.logger is not None and self.logger.enabled and self.step_count % self.config.logging.every == 0:
            if isinstance(loss, (list, tuple)):  # the simulator passes one loss per replica
                loss = sum(float(x) for x in loss) / len(loss)
            record = {"hdet/loss": float(loss) if loss is not None else None, **self.replica_record(), **self.extra}
            self.logger.log(record, step=self.step_count)
        self.extra = {}
        if self.step_count % self.config.sync_interval == 0:
            self.sync()
        self._apply()

    def check_can_step(self) -> None:
        """Raise ``ValueError`` (``OneCycleLR``'s message) if one more step would pass
        ``schedule.total_steps``."""
        if self.step_count + 1 > self.total_steps:
            raise ValueError(f"Tried to step {self.step_count + 1} times. The specified number of total steps is "
                             f"{self.total_steps}")

    def sync(self) -> dict[str, Any]:
        """Converge and (after warm-up) meta-update now. Collective: every rank calls it at
        the same step. Returns the published record (also in ``self.last_sync``)."""
        losses, counts = self.sync_obj.interval_losses()
        finite = [math.isfinite(x) for x in losses]
        t0 = time.perf_counter()
        self.sync_obj.converge(finite)
        converge_s = time.perf_counter() - t0
        self.sync_count += 1
        record: dict[str, Any] = {"hdet/step": self.step_count, "hdet/sync": self.sync_count,
                                  "hdet/converge_s": converge_s}
        for r, x in enumerate(losses):
            record[f"hdet/loss/replica_{r}"] = x
        record.update(self.replica_record())  # the values the interval ran with
        if not all(finite):
            record["hdet/nonfinite_replicas"] = [r for r, ok in enumerate(finite) if not ok]
        auto = self.config.auto
        if auto.enabled and self.step_count >= auto.warmup_steps:
            # One Delta per explored (axis, group); the first meta-update starts from the
            # schedule's value at this step (HDET.md, auto-LR).
            if not any(counts):
                raise HDETConfigError("hdet.auto.enabled: auto-LR needs the training loss; pass it to the "
                                      "scheduler: engine.step(lr_kwargs={'loss': loss}) or scheduler.step(loss)")
            weights = ctl.softmax_weights(losses, auto.temperature)
            for r, w in enumerate(weights.weights):
                record[f"hdet/weight/replica_{r}"] = w
            for key in self.explored:
                a, g = key
                if not self.config.axis_auto(a):
                    continue
                values = self.applied[key]  # what the interval's last step ran with
                base = self.base_value(a, g)  # before the first update: the schedule's value now
                delta = ctl.hypergradient(weights, values)
                new_base, self.velocity[key] = ctl.meta_update(
                    base, self.velocity[key], delta, auto.momentum, auto.step_size, self.decay[key])
                # The velocity remembers larger, older bases; under a strong decay it can
                # outweigh base * (1 - gamma) and send the LR below zero. Floor: the
                # schedule's final LR (0 for other multiplicative axes).
                floor = self.schedule.floor(self.peaks[g]) if a == "lr" else 0.0
                if self.config.axes[a].kind == "multiplicative" and new_base < floor:
                    new_base = floor
                    record[f"hdet/{a}/group_{g}/floored"] = 1
                self.base[key] = new_base
                record[f"hdet/{a}/group_{g}/hypergradient"] = delta
                record[f"hdet/{a}/group_{g}/velocity"] = self.velocity[key]
        self.permutations = {k: ax.draw_permutation(self.generator, self.replicas) for k in self.explored}
        for a in sorted(self.config.axes):
            for g in range(self.num_groups):
                record[f"hdet/{a}/group_{g}/base"] = self.base_value(a, g)
        self.last_sync = record
        if self.logger is not None:
            self.logger.log(record, step=self.step_count)
        return record

    def converge(self) -> None:
        """Average the replicas now (every rank must call it), without a meta-update,
        a new permutation or touching the interval's losses: e.g. to end a run with
        one model. The next forward pass uses the averaged weights."""
        self.sync_obj.converge([True] * self.replicas)

    def replica_record(self) -> dict[str, float]:
        """Every replica's value per axis and group at the last applied step, under
        ``hdet/<axis>/replica_<r>/group_<g>`` (for logging)."""
        out = {}
        for a in sorted(self.config.axes):
            for g in range(self.num_groups):
                for r, v in enumerate(self.applied[(a, g)]):
                    out[f"hdet/{a}/replica_{r}/group_{g}"] = v
        return out

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: step, base values, velocity, the
        permutations, the generator state, and the sync object's loss accumulators."""
        return {
            "version": STATE_VERSION,
            "replicas": self.replicas,
            "sync_interval": self.config.sync_interval,
            "step": self.step_count,
            "sync_count": self.sync_count,
            "base": dict(self.base),
            "velocity": dict(self.velocity),
            "permutations": {k: list(v) for k, v in self.permutations.items()},
            "generator": self.generator.get_state(),
            "sync": self.sync_obj.state_dict() if self.sync_obj is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output and re-apply the current values.

        Raises:
            HDETStateError: the state was saved with a different number of replicas or
                sync interval, or by an incompatible version.
        """
        if state.get("version") != STATE_VERSION:
            raise HDETStateError(f"HDET state version {state.get('version')} != {STATE_VERSION}")
        for key, mine in (("replicas", self.replicas), ("sync_interval", self.config.sync_interval)):
            if state[key] != mine:
                raise HDETStateError(f"checkpoint was written with hdet.{key}={state[key]} but this run has "
                                     f"hdet.{key}={mine}; resume with the same value")
        if set(state["permutations"]) != set(self.permutations):
            raise HDETStateError("checkpoint explores different (axis, group) pairs than hdet.axes now does")
        self.step_count = state["step"]
        self.sync_count = state["sync_count"]
        self.base = dict(state["base"])
        self.velocity = dict(state["velocity"])
        self.permutations = {k: list(v) for k, v in state["permutations"].items()}
        self.generator.set_state(state["generator"])
        if self.sync_obj is not None and state.get("sync"):
            self.sync_obj.load_state_dict(state["sync"])
        self._apply()
