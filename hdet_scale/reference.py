"""The paper's drop-in scheduler: ``OneCycleAutoLR`` with the reference code's constructor,
on plain DDP (one rank per replica), built on the same HDET core as every backend.

Switch from the reference code by changing one import (docs/reference_scheduler.md).
Method: Cheng, Huang, Zhu, Alonso, "Scalable Hyperparameter-Divergent Ensemble Training
with Automatic Learning Rate Exploration for Large Models", arXiv 2604.24708.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hdet_scale import axes as ax
from hdet_scale.backends.common import FullParamsBackend, default_device
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups, check_config
from hdet_scale.errors import HDETConfigError
from hdet_scale.schedules import OneCycle
from hdet_scale.sync import DistributedSync, LossAccumulator
from hdet_scale.topology import Topology

__all__ = ["OneCycleAutoLR"]


class _LocalSync(LossAccumulator):
    """The scheduler's ``Sync`` for a single replica: nothing to exchange or average."""

    replicas = 1
    local_replicas = [0]

    def interval_losses(self, step: int | None = None) -> tuple[list[float], list[int]]:
        s, c = self.take()  # one process, one replica: no other step to compare
        return [s / c if c else float("nan")], [c]

    def converge(self, finite: list[bool]) -> None:
        pass


class _OptimizerParamsBackend(FullParamsBackend):
    """Converge over the optimizer's parameters (what the reference code averages) when
    no module is given: no buffers."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        super().__init__(torch.nn.Module(), device)
        self.optimizer = optimizer

    def master_tensors(self) -> Sequence[torch.Tensor]:
        seen, out = set(), []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen and p.is_floating_point():
                    seen.add(id(p))
                    out.append(p.data)
        return out


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _per_group(name: str, value: Any, groups: int, errors: list[str]) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * groups
    if len(values) != groups:
        errors.append(f"{name}: {len(values)} values for {groups} optimizer parameter groups "
                      "(give a float or one value per group)")
        return [1.0] * groups
    if not all(_is_real(v) and math.isfinite(v) for v in values):
        errors.append(f"{name}: expected finite numbers, got {value!r}")
        return [1.0] * groups
    return [float(v) for v in values]


class OneCycleAutoLR(HDETScheduler):
    """The paper's ``OneCycleAutoLR`` (a ``torch.optim.lr_scheduler.OneCycleLR`` that fans
    the LR out over DDP ranks, averages them every ``model_sync_interval`` steps and
    moves the base LR by auto-LR), with the reference code's defects fixed (see
    docs/reference_scheduler.md). Switch by changing the import.

    Replicas: each rank is one replica (``S = 1``). With ``torch.distributed`` initialised,
    ``R`` = world size and replica r = rank r; otherwise ``R = 1``. The user's DDP (over
    the whole world) shares gradients: "global" mode, as the paper.

    Modes, fixed at construction from ``R``, the spread and auto-LR:

    - ``R == 1`` or ``ensemble_lr_spread_ratio == 0``: exactly ``OneCycleLR`` (the same
      floats, step for step, momentum too), no communication at all. Auto-LR has nothing
      to explore then and is ignored (a warning when ``R > 1``).
    - otherwise HDET: replica r's LR is ``OneCycle(t) * rho_{pi(r)}`` (paper Eq. 1), every
      ``model_sync_interval`` steps the parameters (and, with ``model``, persistent
      floating buffers) are averaged over all ranks in bucketed all-reduces, with auto-LR
      off too; with ``enable_auto_lr`` the base LR is meta-updated at every sync from
      step ``auto_lr_warmup_steps`` on (paper Alg. 1).

    Args:
        optimizer, max_lr, total_steps, epochs, steps_per_epoch, pct_start,
            anneal_strategy, cycle_momentum, base_momentum, max_momentum, div_factor,
            final_div_factor, three_phase: as ``OneCycleLR`` (same positional order);
            ``max_lr``, ``base_momentum``, ``max_momentum`` a float or one per group.
        last_epoch: ``-1`` to start; ``k >= 0`` resumes as ``OneCycleLR`` does (the
            next LR is that of step ``k + 1``; permutations are replayed from the seed).
            Only without auto-LR (its state is not a function of the step): with
            auto-LR, resume through :meth:`load_state_dict`.
        model: the module (DDP-wrapped or plain) whose parameters and persistent float
            buffers converge averages; ``None``: the optimizer's parameters only, as the
            reference code (a warning in HDET mode).
        ensemble_lr_spread_ratio: alpha in ``[0, 1)``; multipliers in ``[1-alpha, 1+alpha]``.
        model_sync_interval: T >= 1, optimizer steps between converges.
        auto_lr_warmup_steps: optimizer steps before the first meta-update.
        enable_auto_lr: run the auto-LR controller.
        loss_scale: softmax temperature sigma (nats) over interval-loss scores.
        lr_of_lr: step size lambda of the meta-update.
        momentum_of_lr: velocity momentum beta in ``[0, 1)``. The per-sync decay gamma is
            derived so the base LR reaches ``OneCycleLR``'s floor at the last sync.
        rank, world_size: accepted for the reference signature; read from
            ``torch.distributed`` (a mismatch is an error).
        seed: seed of the scheduler's own permutation generator (same on every rank;
            the global RNG is never touched).
        bucket_mb: MiB per converge all-reduce bucket.
        logger: optional :class:`~hdet_scale.logging.MetricsLogger`.

    Defaults are the reference code's (``ensemble_lr_spread_ratio=0.0``,
    ``enable_auto_lr=False``: plain ``OneCycleLR``), so an unchanged call site keeps its
    behaviour; the paper's setting is ``ensemble_lr_spread_ratio=1/9``,
    ``model_sync_interval=1000``, ``enable_auto_lr=True``.

    State: :meth:`state_dict` is this rank's (step, base LR, velocity, permutations,
    generator, interval-loss sum) and holds no rank, so any rank's file restores the
    shared controller state; save one per rank next to the model for an exact resume.
    LRs are Python floats, one per parameter group (:meth:`get_last_lr`).

    Units: steps are optimizer steps (calls of :meth:`step`). Stepping past
    ``total_steps`` raises ``ValueError`` as ``OneCycleLR`` does (the state is left
    unchanged). All arguments are checked before anything is used or communicated,
    identically on every rank.

    Raises:
        HDETConfigError (a ValueError): every invalid argument, listed at once.
    """

    # The reference takes step() without a loss until the interval that ends at the first
    # meta-update; step() itself refuses a missing loss from then on.
    loss_every_interval = False

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float | Sequence[float],
                 total_steps: int | None = None, epochs: int | None = None, steps_per_epoch: int | None = None,
                 pct_start: float = 0.3, anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float | Sequence[float] = 0.85, max_momentum: float | Sequence[float] = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1, *, model: torch.nn.Module | None = None,
                 ensemble_lr_spread_ratio: float = 0.0, model_sync_interval: int = 1000,
                 auto_lr_warmup_steps: int = 100000, enable_auto_lr: bool = False, loss_scale: float = 0.002,
                 lr_of_lr: float = 0.5, momentum_of_lr: float = 0.9, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, bucket_mb: float = 25.0, logger: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        dist_on = dist.is_available() and dist.is_initialized()
        R = dist.get_world_size() if dist_on else 1
        errors: list[str] = []
        total = self._total_steps(total_steps, epochs, steps_per_epoch, errors)
        n_groups = len(optimizer.param_groups)
        peaks = _per_group("max_lr", max_lr, n_groups, errors)
        if not all(v > 0 for v in peaks):
            errors.append(f"max_lr: must be > 0, got {max_lr!r}")
        momentum_key = "betas" if "betas" in optimizer.defaults else "momentum" if "momentum" in optimizer.defaults \
            else None
        if cycle_momentum and momentum_key is None:
            errors.append("cycle_momentum: optimizer must support momentum or beta1 with `cycle_momentum` option "
                          "enabled (or pass cycle_momentum=False)")
        base_m = _per_group("base_momentum", base_momentum, n_groups, errors)
        max_m = _per_group("max_momentum", max_momentum, n_groups, errors)
        spread = ensemble_lr_spread_ratio
        checks = [
            (_is_real(pct_start) and 0 <= pct_start <= 1, "pct_start",
             f"expected a float between 0 and 1, got {pct_start!r}"),
            (anneal_strategy in ("cos", "linear"), "anneal_strategy",
             f"must be one of 'cos' or 'linear', got {anneal_strategy!r}"),
            (_is_real(div_factor) and div_factor > 0, "div_factor", f"must be > 0, got {div_factor!r}"),
            (_is_real(final_div_factor) and final_div_factor > 0, "final_div_factor",
             f"must be > 0, got {final_div_factor!r}"),
            (_is_int(last_epoch) and last_epoch >= -1, "last_epoch", f"must be an integer >= -1, got {last_epoch!r}"),
            (_is_real(spread) and math.isfinite(spread) and 0 <= spread < 1,
             "ensemble_lr_spread_ratio", f"must be in [0, 1) (a multiplier 1 - ratio must stay > 0), got {spread!r}"),
            (_is_int(model_sync_interval) and model_sync_interval >= 1, "model_sync_interval",
             f"must be an integer >= 1 (optimizer steps between converges), got {model_sync_interval!r}"),
            (_is_int(auto_lr_warmup_steps) and auto_lr_warmup_steps >= 0, "auto_lr_warmup_steps",
             f"must be an integer >= 0 (optimizer steps), got {auto_lr_warmup_steps!r}"),
            (_is_real(loss_scale) and 0 < loss_scale < math.inf, "loss_scale",
             f"must be finite and > 0 (softmax temperature, nats), got {loss_scale!r}"),
            (_is_real(lr_of_lr) and 0 <= lr_of_lr < math.inf, "lr_of_lr",
             f"must be finite and >= 0, got {lr_of_lr!r}"),
            (_is_real(momentum_of_lr) and 0 <= momentum_of_lr < 1, "momentum_of_lr",
             f"must be in [0, 1), got {momentum_of_lr!r}"),
            (model is None or isinstance(model, torch.nn.Module), "model",
             f"must be a torch.nn.Module or None, got {type(model).__name__}"),
            (world_size is None or world_size == R, "world_size",
             f"is {world_size} but torch.distributed " + (f"has {R} ranks" if dist_on else "is not initialised")
             + "; initialise it first (each rank is one replica) or leave world_size out"),
            (rank is None or rank == (dist.get_rank() if dist_on else 0), "rank",
             f"is {rank} but this process is rank {dist.get_rank() if dist_on else 0}; leave rank out"),
        ]
        errors += [f"{key}: {msg}" for ok, key, msg in checks if not ok]
        hdet = R > 1 and _is_real(spread) and spread > 0
        auto = bool(enable_auto_lr) and hdet
        if auto and total is not None and _is_int(auto_lr_warmup_steps) and _is_int(model_sync_interval) \
                and auto_lr_warmup_steps + model_sync_interval > total:
            errors.append(f"auto_lr_warmup_steps: no sync after warm-up: auto_lr_warmup_steps "
                          f"({auto_lr_warmup_steps}) + model_sync_interval ({model_sync_interval}) > total_steps "
                          f"({total}); auto-LR would never run (shorten the warm-up or set enable_auto_lr=False)")
        if auto and last_epoch != -1:
            errors.append("last_epoch: resuming by step count drops the auto-LR state (base LR, velocity, "
                          "interval losses); construct with last_epoch=-1 and call load_state_dict(saved)")
        if total is not None and _is_int(last_epoch) and last_epoch + 1 > total:
            errors.append(f"last_epoch: {last_epoch} resumes past total_steps={total}")
        if errors:
            raise HDETConfigError("invalid OneCycleAutoLR arguments:\n  " + "\n  ".join(errors))

        cfg = self._config(R if hdet else 1, total, peaks, pct_start, anneal_strategy, div_factor,
                           final_div_factor, three_phase, spread if hdet else 0.0, model_sync_interval,
                           auto, auto_lr_warmup_steps, loss_scale, lr_of_lr, momentum_of_lr, seed, bucket_mb)
        if R > 1 and not hdet and enable_auto_lr:
            warnings.warn("OneCycleAutoLR: enable_auto_lr has no effect with ensemble_lr_spread_ratio=0 "
                          "(every replica runs the same LR: plain OneCycleLR)", stacklevel=2)
        if hdet and model is None:
            warnings.warn("OneCycleAutoLR: model not given; converge averages the optimizer's parameters only, "
                          "not buffers such as BatchNorm statistics (pass model=ddp_model)", stacklevel=2)

        self.optimizer = optimizer
        self._momentum_key = momentum_key if cycle_momentum else None
        self._momentum = [OneCycle(total, float(pct_start), anneal_strategy, float(div_factor),
                                   float(final_div_factor), bool(three_phase), b, m)
                          for b, m in zip(base_m, max_m)] if cycle_momentum else None
        # The keys OneCycleLR writes into every group (read by code that inspects a
        # OneCycleLR-driven optimizer); this scheduler computes from its own copies.
        for g, grp in enumerate(optimizer.param_groups):
            grp["initial_lr"] = peaks[g] / div_factor
            grp["max_lr"] = peaks[g]
            grp["min_lr"] = grp["initial_lr"] / final_div_factor
            if cycle_momentum:
                grp["max_momentum"], grp["base_momentum"] = max_m[g], base_m[g]
        if hdet:
            device = self._device(model, optimizer)
            topology = Topology(R, device_type=device.type)
            backend = FullParamsBackend(model, device) if model is not None else \
                _OptimizerParamsBackend(optimizer, device)
            sync: Any = DistributedSync(topology, backend, cfg.bucket_bytes, "global")
            replica = topology.replica_index
        else:
            sync, replica = _LocalSync(), 0
        super().__init__(cfg, LiveParamGroups({replica: optimizer}), sync, logger=logger)
        if last_epoch >= 0:
            self._fast_forward(last_epoch + 1)

    # ---- set-up helpers -----------------------------------------------------------------
    @staticmethod
    def _total_steps(total_steps: Any, epochs: Any, steps_per_epoch: Any, errors: list[str]) -> int | None:
        # OneCycleLR's rule: total_steps wins; else epochs * steps_per_epoch.
        if total_steps is not None:
            if not _is_int(total_steps) or total_steps <= 0:
                errors.append(f"total_steps: expected a positive integer, got {total_steps!r}")
                return None
            return total_steps
        if epochs is None or steps_per_epoch is None:
            errors.append("total_steps: you must define either total_steps OR (epochs AND steps_per_epoch)")
            return None
        bad = [f"{n}: expected a positive integer, got {v!r}" for n, v in
               (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)) if not _is_int(v) or v <= 0]
        errors.extend(bad)
        return None if bad else epochs * steps_per_epoch

    @staticmethod
    def _config(replicas: int, total: int, peaks: list[float], pct_start: float, anneal: str, div: float,
                final_div: float, three_phase: bool, spread: float, interval: int, auto: bool, warmup: int,
                loss_scale: float, lr_of_lr: float, momentum_of_lr: float, seed: int, bucket_mb: float
                ) -> HDETConfig:
        block = {"replicas": replicas, "sync_interval": interval, "gradient_sharing": "global", "seed": seed,
                 "bucket_mb": bucket_mb, "axes": {"lr": {"spread_ratio": float(spread)}},
                 "schedule": {"name": "onecycle", "total_steps": total, "max_lr": peaks,
                              "pct_start": float(pct_start), "anneal_strategy": anneal, "div_factor": float(div),
                              "final_div_factor": float(final_div), "three_phase": bool(three_phase),
                              "cycle_momentum": False},  # cycled here, per group (OneCycleLR allows lists)
                 "auto": {"enabled": auto, "warmup_steps": warmup, "temperature": float(loss_scale),
                          "momentum": float(momentum_of_lr), "step_size": float(lr_of_lr), "decay": "auto",
                          # the paper's update, fitness and per-group exploration
                          "controller": "paper", "fitness": "train_loss", "groups": "independent"}}
        try:
            cfg = HDETConfig.from_dict(block, prefix="OneCycleAutoLR")
            check_config(cfg)
        except HDETConfigError as e:
            raise HDETConfigError(f"invalid OneCycleAutoLR arguments ({e}); keys map to arguments as in "
                                  "docs/reference_scheduler.md") from None
        return cfg

    @staticmethod
    def _device(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> torch.device:
        params = model.parameters() if model is not None else (p for g in optimizer.param_groups
                                                                for p in g["params"])
        for p in params:
            return p.device
        return default_device()

    def _fast_forward(self, step: int) -> None:
        # The state at `step` without auto-LR: the schedule position, and one permutation
        # draw per explored (axis, group) at every sync passed, as sync() draws them.
        for _ in range(step // self.config.sync_interval):
            self.permutations = {k: ax.draw_permutation(self.generator, self.replicas) for k in self.explored}
        self.step_count = step
        self.sync_count = step // self.config.sync_interval
        self._apply()

    # ---- torch LRScheduler surface --------------------------------------------------------
    @property
    def last_epoch(self) -> int:
        """Optimizer steps taken (``OneCycleLR.last_epoch``: 0 after construction)."""
        return self.step_count

    def _apply(self) -> None:
        super()._apply()
        if self._momentum is None:
            return
        step = min(self.step_count, self.total_steps)
        for groups in self.param_groups.values():
            for grp, schedule in zip(groups, self._momentum):
                beta = schedule.momentum(step)
                if self._momentum_key == "betas":
                    grp["betas"] = (beta, *grp["betas"][1:])
                else:
                    grp["momentum"] = beta

    def step(self, loss: Any = None, **kwargs: Any) -> None:
        """Close one optimizer step (call after ``optimizer.step()``), as
        ``OneCycleLR.step`` plus HDET: record ``loss``, converge every
        ``model_sync_interval`` steps, meta-update after warm-up, set the next LRs.

        Args:
            loss: this rank's training loss of the step (0-dim tensor or float, nats).
                Needed from the interval that ends at the first meta-update on when
                auto-LR runs; otherwise optional.

        Raises:
            ValueError: stepping past ``total_steps`` (as ``OneCycleLR``), or ``loss``
                missing while auto-LR needs it. Both before any state change or
                collective, and identically on every rank that calls it the same way.
        """
        nxt = self.step_count + 1
        auto = self.config.auto
        if loss is None and auto.enabled:
            T, first = self.config.sync_interval, self.config.first_meta_step
            if nxt > first - T:
                raise ValueError(f"OneCycleAutoLR.step: auto-LR needs the training loss from step {first - T + 1} "
                                 f"on (first meta-update at step {first}); call scheduler.step(loss)")
        super().step(loss, **kwargs)
