"""The HDET orchestrator: ``step(loss)`` -> accumulate, schedule, converge, meta-update.

``HDETScheduler`` is what the training loop sees. It behaves like a torch LR scheduler
(``step``, ``get_last_lr``, ``state_dict``) and is handed to ``deepspeed.initialize`` as
``lr_scheduler``, so ``engine.step(lr_kwargs={"loss": loss})`` drives it. A step the engine
skips (a non-finite gradient; DeepSpeed then does not call the scheduler) still counts, on
every backend (the DeepSpeed backend steps the scheduler itself): every rank stays at the
same step, which each sync checks.

Communication is delegated to a *sync* object (``DistributedSync`` for real ranks,
the simulator's for R replicas in one process); the arithmetic here is the same for all.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any

import torch

from hdet_scale import axes as ax
from hdet_scale import axis_specs as specs
from hdet_scale.autolr import (Controller, build_schedule, check_additive_floors, check_config,  # noqa: F401
                               decay_for)
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError, HDETResumeWarning, HDETStateError
from hdet_scale.param_groups import LiveParamGroups, check_param_groups  # noqa: F401 (re-exported)
from hdet_scale.probe import require_probe
from hdet_scale.resume_changes import config_changes, peak_changes
from hdet_scale.step_args import check_loss_args
from hdet_scale.sync import Sync

STATE_VERSION = 2


class HDETScheduler:
    """Sets every replica's hyperparameters each optimizer step and runs the sync.

    Args:
        config: parsed ``"hdet"`` block.
        param_groups: ``{replica_index: optimizer.param_groups}`` for the replicas this
            process drives (one entry on a real rank; R in the simulator). Groups must
            have ``"lr"`` (and ``"weight_decay"`` when that axis is explored).
        sync: communication object; may be attached later with :meth:`attach`.
        logger: optional :class:`~hdet_scale.logging.MetricsLogger` (enabled on global
            rank 0 only): a record at every sync, and every ``logging.every`` steps and
            at ``last_step`` (``schedule.total_steps`` unless set) the step's loss
            (this rank's) and every replica's values, merged with ``self.extra`` (e.g.
            the trainer's tokens/s). A sync record's ``hdet/<axis>/group_<g>/base`` is
            the next step's base, left out at ``last_step`` (no step follows).

    Units: ``step`` counts optimizer steps (never micro-batches); ``sync_interval`` and
    ``auto.warmup_steps`` likewise. Raises HDETConfigError for a parameter-group index
    out of range, a missing hyperparameter, or a derived decay outside [0, 1).
    """

    # Auto-LR scored by the training loss needs a loss in every interval: each sync
    # without one raises (OneCycleAutoLR relaxes it to the reference's rule).
    loss_every_interval = True

    def __init__(self, config: HDETConfig, param_groups: dict[int, list[dict]], sync: Sync | None = None,
                 logger: Any = None) -> None:
        self.config = config
        self.replicas = config.replicas
        self.param_groups = param_groups
        self.schedule = build_schedule(config)
        self.total_steps = config.schedule.total_steps
        # the run's last optimizer step, logged whatever logging.every (every=7 over
        # 20 steps would leave steps 15-20 without a record); hdet-train sets train.steps
        self.last_step = self.total_steps
        self.sync_obj = sync
        self._held_eval: Any = None  # the eval_mode() context enter_eval_mode() holds
        self.logger = logger
        self.extra: dict[str, Any] = {}
        self.taken_lr: list[float] = []  # the LR per group the last step ran with (get_last_lr's then)
        groups = next(iter(param_groups.values()))
        self.check_param_groups(config, groups)
        self.num_groups = len(groups)
        self.peaks = self._peaks(groups)
        self.explored = self._explored()  # (axis, group) pairs in hdet.axes
        self.initial = {(a, g): (specs.model_value(a, config.axes[a]) if specs.is_model_axis(a)
                                 else specs.read(groups[g], a))
                        for a in config.axes for g in self.axis_groups(a)}
        bases = {(a, g): self.peaks[g] if a == "lr" else self.initial[(a, g)] for a, g in self.explored}
        check_additive_floors(config, self.schedule, bases)  # and the bounds (axis_specs)
        # model-side axes: {replica: {axis: value}} now, and the setters of the models
        # bound with bind_model (label_smoothing has none: the loss reads model_value)
        self.model_values: dict[int, dict[str, float]] = {r: {} for r in param_groups}
        self.model_setters: dict[int, dict[str, Any]] = {}
        self.applied: dict[tuple[str, int], list[float]] = {}  # values of the current step
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step_count = 0
        # who steps this scheduler, when not the user's loop (an Ensemble of
        # hdet_scale.prepare): a step from elsewhere is then refused (a loop that also
        # calls ens.scheduler.step would move the schedule twice per step)
        self.driver: str | None = None
        self.driver_stepping = False
        self.sync_count = 0
        self.converged_step = -1  # the step of the last converge (a sync's or converge()'s)
        self.controller = Controller(config, self.schedule, self.peaks, self.explored)
        self.probe: Any = None
        self.permutations = self._draw_permutations()
        self.last_sync: dict[str, Any] = {}
        self._apply()

    # ---- set-up -------------------------------------------------------------------------
    check_param_groups = staticmethod(check_param_groups)  # param_groups.py; backends call it first

    def _peaks(self, groups: list[dict]) -> list[float]:
        m = self.config.schedule.max_lr
        if m is None:
            return [float(g["lr"]) for g in groups]
        if isinstance(m, list):
            return [float(v) for v in m]
        return [float(m)] * len(groups)

    def axis_groups(self, axis: str) -> range:
        """The parameter groups ``axis`` has a value for: all of them for an
        optimizer-side axis, one (``0``) for a model-side axis (one value per replica)."""
        return range(1) if specs.is_model_axis(axis) else range(self.num_groups)

    def _explored(self) -> list[tuple[str, int]]:
        out = []
        for name in sorted(self.config.axes):
            axis = self.config.axes[name]
            groups = self.axis_groups(name) if axis.groups is None else axis.groups
            out.extend((name, g) for g in groups)
        return out

    def _draw_permutations(self) -> dict[tuple[str, int], list[int]]:
        """One permutation per explored (axis, group) ("independent" groups, the paper), or
        one per axis shared by its groups ("tied": every group of a replica gets the same
        multiplier, so the user's LR ratios between groups hold). Sorted order, so every
        rank draws the same sequence from the same generator."""
        if self.config.auto.groups == "independent":
            return {k: ax.draw_permutation(self.generator, self.replicas) for k in self.explored}
        per_axis: dict[str, list[int]] = {}
        for a, _ in self.explored:
            if a not in per_axis:
                per_axis[a] = ax.draw_permutation(self.generator, self.replicas)
        return {(a, g): list(per_axis[a]) for a, g in self.explored}

    # The controller's state, under the names the scheduler has always published.
    @property
    def base(self) -> dict[tuple[str, int], float]:
        return self.controller.base

    @property
    def velocity(self) -> dict[tuple[str, int], float]:
        return self.controller.velocity

    @property
    def decay(self) -> dict[tuple[str, int], float]:
        return self.controller.decay

    def attach(self, sync: Sync) -> None:
        self.sync_obj = sync

    def has_eval_point(self) -> bool:
        """The optimizer moves the parameters to another point for evaluation
        (schedule-free; :meth:`eval_mode`)."""
        has = getattr(getattr(self, "sync_obj", None), "has_eval_point", None)
        return bool(has is not None and has())

    def eval_mode(self) -> Any:
        """A context manager: inside, the model holds its optimizer's evaluation point
        (schedule-free's averaged iterate x; :mod:`hdet_scale.iterates`) on every replica
        this process holds, with the engine's working copies refreshed; on exit the
        training point. Use it around validation, ``save_model`` and exports (not around
        checkpoints, which hold the training point and the optimizer's ``z``). Does
        nothing for an optimizer with one iterate (AdamW, SGD) or before a sync is
        attached. Every rank of a sharded replica enters it together (the refresh of
        ZeRO-3 / OSS communicates inside the shard group)."""
        enter = getattr(getattr(self, "sync_obj", None), "eval_mode", None)
        return enter() if enter is not None else contextlib.nullcontext()

    def enter_eval_mode(self) -> None:
        """:meth:`eval_mode` entered and held until :meth:`leave_eval_mode`, for loops that
        switch by calls (``Ensemble.eval()`` / ``train()``, the Hugging Face Trainer's
        ``optimizer.eval()`` / ``train()``); a second call while held does nothing."""
        if self._held_eval is None:
            ctx = self.eval_mode()
            ctx.__enter__()
            self._held_eval = ctx

    def leave_eval_mode(self) -> None:
        """Back to the training point after :meth:`enter_eval_mode`; nothing when not held
        (so a per-step call costs nothing)."""
        if self._held_eval is not None:
            ctx, self._held_eval = self._held_eval, None
            ctx.__exit__(None, None, None)

    @property
    def holds_eval_point(self) -> bool:
        """The parameters hold the optimizer's evaluation point now (:meth:`enter_eval_mode`
        on an optimizer that has one): a step or a checkpoint would use the wrong point."""
        return self._held_eval is not None and self.has_eval_point()

    def set_probe(self, probe: Any) -> None:
        """The probe that ``auto.fitness = "probe"`` scores replicas with: called at each
        meta-update, before converge, through the sync (``DistributedSync.probe_losses``:
        ``probe() -> this rank's loss on its probe slice``; the simulator:
        ``probe(model, r) -> loss``). ``None`` removes it."""
        self.probe = probe

    def check_probe(self) -> None:
        """Raise HDETConfigError when auto-LR scores replicas by probe loss but no probe
        is set (call before the first collective)."""
        require_probe(self.config, self.probe, "probe")

    @property
    def topology(self) -> Any:
        """The attached sync's :class:`~hdet_scale.topology.Topology` (``None`` in the
        simulator)."""
        return getattr(self.sync_obj, "topology", None)

    # ---- values -------------------------------------------------------------------------
    @property
    def auto_active(self) -> bool:
        """True once the first meta-update has run."""
        return self.controller.active

    def raw_value(self, axis: str, group: int) -> float:
        """The value without auto-LR: the schedule's LR at the current step, or the
        optimizer's initial value for other axes."""
        if axis == "lr":
            return self.schedule.value(min(self.step_count, self.total_steps), self.peaks[group])
        return self.initial[(axis, group)]

    def base_value(self, axis: str, group: int) -> float:
        """The shared (un-spread) value of ``axis`` for ``group`` at the current step:
        the raw value times the auto-LR multiplier ("log"), or the meta-updated base
        ("paper")."""
        return self.controller.value((axis, group), self.raw_value(axis, group))

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
            for g in self.axis_groups(axis):
                values = self.replica_values(axis, g)
                self.applied[(axis, g)] = values
                for r, groups in self.param_groups.items():
                    if specs.is_model_axis(axis):
                        self.model_values[r][axis] = values[r]
                    else:
                        specs.write(groups[g], axis, values[r])
        self._set_models()
        if beta1 is not None:
            for groups in self.param_groups.values():
                for grp in groups:
                    if "betas" in grp:
                        grp["betas"] = (beta1, *grp["betas"][1:])
                    elif "momentum" in grp:
                        grp["momentum"] = beta1

    # ---- model-side axes ---------------------------------------------------------------
    def bind_model(self, model: Any, replica: int | None = None) -> None:
        """Let the model-side axes (dropout, temperature) reach ``model``: the module
        replica ``replica`` (default: this rank's only one) runs on this rank. Its setters
        (:func:`hdet_scale.model_axes.setters`) are called now and at every step with
        the replica's values. The backends bind the model they wrap; the simulator
        binds each replica's.

        Raises:
            HDETConfigError: a model-side axis finds nothing to set in ``model`` (same
                verdict on every rank of a replica: it reads the module tree only).
        """
        from hdet_scale.model_axes import setters

        replica = next(iter(self.param_groups)) if replica is None else replica
        self.model_setters[replica] = setters(model, self.config)
        self._set_models()

    def model_value(self, axis: str, replica: int | None = None) -> float:
        """The value of model-side ``axis`` this step on ``replica`` (default: this
        rank's), e.g. ``label_smoothing`` for the loss: ``F.cross_entropy(...,
        label_smoothing=scheduler.model_value("label_smoothing"))``. An axis not in
        ``hdet.axes`` is ``KeyError``."""
        replica = next(iter(self.param_groups)) if replica is None else replica
        return self.model_values[replica][axis]

    def _settle_model_axes(self) -> dict[str, float]:
        """At the end of the run: every replica's model-side axes (dropout, temperature,
        label_smoothing) set to the shared base value, the one the run's hyperparameter
        search ends at (otherwise after ``train()`` each rank keeps its replica's
        temperature, and an evaluation mixes them). Returns ``{"hdet/<axis>/group_0/final":
        value}`` for the end's record: no file of the model holds it (a module
        attribute, not a weight)."""
        out = self._final_model_values()
        for key, value in out.items():
            axis = key.split("/")[1]
            for r in self.model_values:
                self.model_values[r][axis] = value
        self._set_models()
        return out

    def _final_model_values(self) -> dict[str, float]:
        """``{"hdet/<axis>/group_0/final": base}`` for each model-side axis (the end's record)."""
        return {f"hdet/{a}/group_0/final": self.base_value(a, 0) for a in sorted(self.config.axes)
                if specs.is_model_axis(a)}

    def _set_models(self) -> None:
        for r, setters in self.model_setters.items():
            for axis, set_value in setters.items():
                set_value(self.model_values[r][axis])

    def get_last_lr(self) -> list[float]:
        """LR per parameter group of the first replica this process drives."""
        return [g["lr"] for g in next(iter(self.param_groups.values()))]

    # ---- step and sync ------------------------------------------------------------------
    def step(self, loss: Any = None, **kwargs: Any) -> None:
        """Close one optimizer step: record its loss, sync every ``sync_interval`` steps
        and, at ``total_steps`` when it is no sync step, end with one model (a logged sync
        without a meta-update); then set the values for the next step. A ``last_step``
        before ``total_steps`` averages nothing: the caller saves, then calls
        :meth:`finish`. Collective on the steps that sync or converge.

        Args:
            loss: the step's training loss on this rank (0-dim tensor or float, nats);
                in the simulator, a sequence of R losses. ``None`` records nothing. With
                auto-LR on and ``auto.fitness = "train_loss"``, a sync whose interval
                recorded no loss on any rank raises HDETConfigError (the first sync, on
                every rank, before converge); the probe fitness needs none. A step whose
                optimizer update the engine skipped (non-finite gradient) is still a
                step: call this with its loss as on any step (the DeepSpeed backend and
                ``hdet_scale.backends.torch_step.optimizer_step`` do).

        Raises:
            ValueError: a step past ``schedule.total_steps`` (as ``OneCycleLR``), before
                any state change or collective.
            HDETConfigError: a keyword other than ``loss``, or a loss that is not a
                float or a one-element floating-point tensor (:meth:`check_step_args`),
                before any state change or collective; a call from outside the
                ``driver`` that steps this scheduler (``hdet_scale.prepare``'s Ensemble).
            HDETStepMismatchError: at a sync, the ranks are at different steps (every
                rank raises; see :meth:`sync`).
        """
        if self.driver is not None and not self.driver_stepping:
            raise HDETConfigError(f"HDETScheduler.step: {self.driver} steps this scheduler itself, on each optimizer "
                                  "step's last micro-batch; a call of your own moves the schedule (syncs, auto-LR, "
                                  "the LR) a second time per optimizer step: remove it")
        self.check_step_args(loss, **kwargs)
        self.check_can_step()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if loss is not None:
            try:
                self.sync_obj.add_loss(loss)
            except TypeError as e:  # not a TypeError: DeepSpeed would retry (see check_step_args)
                raise HDETConfigError(f"HDETScheduler.step: cannot record the loss {loss!r}: {e}") from e
        self.step_count += 1
        if self.logger is not None and self.logger.enabled and self.logs_step(self.step_count):
            if isinstance(loss, (list, tuple)):  # the simulator passes one loss per replica
                loss = sum(float(x) for x in loss) / len(loss)
            record = {"hdet/loss": float(loss) if loss is not None else None, **self.replica_record(), **self.extra}
            self.logger.log(record, step=self.step_count)
        self.extra = {}
        self.taken_lr = self.get_last_lr()
        if self.step_count % self.config.sync_interval == 0:
            self.sync()
        elif self.step_count == self.last_step == self.total_steps:
            # the run ends with one model, whatever T (else a library or HDETTrainer
            # run of 10 steps at T = 4 ends with the replicas apart, and save_model
            # writes replica 0's weights, not their average): a sync without a
            # meta-update, so that it is logged and leaves a non-finite replica out as
            # any sync does. A last step before
            # total_steps (hdet-train's train.steps, HDETTrainer's max_steps shorter than
            # the schedule: a run that may be resumed up to it) is a step like any other:
            # its checkpoint must hold each replica, as a mid-run one does, or the resumed
            # run parts from the uninterrupted one; the caller averages
            # after saving (:meth:`finish`)
            self.sync(final=True)
        self._apply()
        if self.step_count >= self.total_steps:  # no step follows: the replicas' shared value
            self._settle_model_axes()

    def logs_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based, as ``step_count`` after it) gets a
        per-step record: every ``logging.every`` steps, and ``last_step``."""
        return step % self.config.logging.every == 0 or step == self.last_step

    def check_step_args(self, loss: Any = None, **kwargs: Any) -> None:
        """Refuse what :meth:`step` cannot use, before any state change
        (``step_args.check_loss_args``: a float or one-element floating-point tensor, in
        nats, or a sequence of them in the simulator; no keyword). Raises HDETConfigError,
        never TypeError (DeepSpeed would retry the scheduler with its batch size)."""
        from hdet_scale.simulate import SimulatedSync  # here: simulate imports this module

        many = len(getattr(self.sync_obj, "local_replicas", ())) > 1 or isinstance(self.sync_obj, SimulatedSync)
        check_loss_args(loss, kwargs, many)

    def check_can_step(self) -> None:
        """Raise ``ValueError`` (``OneCycleLR``'s message, then the key that sets the
        length) if one more step would pass ``schedule.total_steps``."""
        if self.step_count + 1 > self.total_steps:
            raise ValueError(f"Tried to step {self.step_count + 1} times. The specified number of total steps is "
                             f"{self.total_steps} (hdet.schedule.total_steps, optimizer steps: set it to the whole "
                             "run's length to train longer)")

    def sync(self, final: bool = False) -> dict[str, Any]:
        """Converge and (after warm-up) meta-update now. Collective: every rank calls it at
        the same step. With ``auto.fitness = "probe"`` the probe runs first (before
        converge makes the replicas equal). ``final``: the converge that ends a run at
        ``total_steps`` that is no multiple of ``sync_interval``: no meta-update (and no
        probe), a shorter interval's losses; the record has ``hdet/final_converge: 1``.
        Returns the published record (also in ``self.last_sync``).

        Raises (on every rank, before converge changes anything):
            HDETStepMismatchError: the ranks are at different steps (found by the
                interval-loss all-reduce itself, no extra collective).
            HDETConfigError: auto-LR scored by the training loss, and no rank recorded a
                loss in the interval.
        """
        losses, counts = self.sync_obj.interval_losses(step=self.step_count)
        auto = self.config.auto
        if not final and auto.enabled and auto.fitness == "train_loss" and self.loss_every_interval \
                and not any(counts):
            # Now, not at the first meta-update (possibly hours later, after warm-up):
            # counts come from the all-reduce, so every rank decides alike.
            raise HDETConfigError("hdet.auto.fitness: 'train_loss' scores replicas by the training loss, but no "
                                  f"rank recorded one in the interval ending at step {self.step_count}; pass it "
                                  "to the scheduler: engine.step(lr_kwargs={'loss': loss}) or "
                                  "scheduler.step(loss), or use auto.fitness 'probe'")
        meta = not final and auto.enabled and self.step_count >= auto.warmup_steps
        fitness = losses
        if meta and self.config.uses_probe:
            self.check_probe()
            fitness = self.sync_obj.probe_losses(self.probe)
        # A replica whose training (or probe) loss is NaN/inf is left out of the average. A
        # replica that recorded no training loss (step() without one) is not suspect: the
        # probe alone needs none.
        finite = [(math.isfinite(x) or c == 0) and math.isfinite(f) for x, c, f in zip(losses, counts, fitness)]
        interval_start = max(self.converged_step, 0)  # the steps this interval ran, for auto.decay_moves
        self._wait_for_device()
        t0 = time.perf_counter()
        self.sync_obj.converge(finite)
        self.converged_step = self.step_count
        self._wait_for_device()
        converge_s = time.perf_counter() - t0
        self.sync_count += 1
        record: dict[str, Any] = {"hdet/step": self.step_count, "hdet/sync": self.sync_count,
                                  "hdet/converge_s": converge_s}
        if final:
            record["hdet/final_converge"] = 1
        for r, x in enumerate(losses):
            record[f"hdet/loss/replica_{r}"] = x
        if fitness is not losses:
            for r, x in enumerate(fitness):
                record[f"hdet/fitness/replica_{r}"] = x
        record.update(self.replica_record())  # the values the interval ran with
        if not all(finite):
            record["hdet/nonfinite_replicas"] = [r for r, ok in enumerate(finite) if not ok]
        if meta:
            scored = [f if ok else float("nan") for f, ok in zip(fitness, finite)]
            # Before the first update, the paper controller starts from the schedule's value now.
            noise = getattr(self.sync_obj, "probe_noise", None) if fitness is not losses else None
            self.controller.update(scored, self.permutations, self.applied,
                                   lambda k: self.base_value(*k), record, raw=lambda k: self.raw_value(*k),
                                   noise=noise, interval=(interval_start, self.step_count))
        self.permutations = self._draw_permutations()
        # The base of the next step; after total_steps there is none (OneCycleLR's
        # formula one step past its end gives ~13x the last LR). A run stopped before it
        # logs it: its resume takes that step (so that the resumed metrics hold the
        # uninterrupted run's base at the stop's sync).
        for a in sorted(self.config.axes) if self.step_count < self.total_steps else ():
            for g in self.axis_groups(a):
                record[f"hdet/{a}/group_{g}/base"] = self.base_value(a, g)
        if self.step_count >= self.total_steps:  # what _settle_model_axes sets once step() applies
            record.update(self._final_model_values())
        self.last_sync = record
        if self.logger is not None:
            self.logger.log(record, step=self.step_count)
        return record

    def _wait_for_device(self) -> None:
        """Wait until the device work queued so far has run, so that the wall clock
        around converge (``hdet/converge_s``) measures it: CUDA kernels and NCCL calls
        return before they execute. The sync's own ``synchronize()`` when it has one,
        else its backend's device when it is not the CPU (nothing to wait for there)."""
        wait = getattr(self.sync_obj, "synchronize", None)
        if wait is not None:
            wait()
            return
        device = getattr(getattr(self.sync_obj, "backend", None), "device", None)
        if device is not None and torch.device(device).type != "cpu":
            torch.accelerator.synchronize(torch.device(device))

    def warm_init(self) -> bool:
        """Warm noisy initialisation (``hdet.warm_init``): each replica adds its own noise
        to its weights before the first step. Collective (every rank calls it; backends'
        ``initialize`` do). Does nothing when disabled or after step 0 (a resumed run
        loads its weights afterwards anyway). Returns whether noise was added."""
        w = self.config.warm_init
        if not w.enabled or w.nu == 0 or self.step_count > 0:
            return False
        self.sync_obj.add_noise(w.nu, w.seed)
        return True

    def finish(self) -> dict[str, Any] | None:
        """End the run with one model: average the replicas unless the last step did (a
        sync step, or ``total_steps``, where :meth:`step` synced). For a run that stops
        before ``total_steps`` (``hdet-train``'s ``train.steps``, ``HDETTrainer``'s
        ``max_steps``, a callback's stop): call it after saving the checkpoint a resume
        would load, which then holds each replica, so the resumed run continues the
        uninterrupted one exactly. Like :meth:`converge` it leaves the sync count,
        permutations and interval losses alone; it logs ``{"hdet/step", "hdet/final_converge":
        1, "hdet/converge_s"}`` (no ``hdet/sync``: no sync happened), also kept in
        ``last_sync``. Model-side axes (dropout, temperature) are set to their shared base
        value on every replica, logged as ``hdet/<axis>/group_0/final`` (as the end at
        ``total_steps`` does). Collective: every rank calls it at the same step.

        Returns the record, or None when there was nothing to average (no step taken, or
        the replicas already equal since the last step's sync)."""
        if self.step_count == 0 or self.converged_step == self.step_count:
            return None
        self._wait_for_device()
        t0 = time.perf_counter()
        self.converge()
        self._wait_for_device()
        record = {"hdet/step": self.step_count, "hdet/final_converge": 1,
                  "hdet/converge_s": time.perf_counter() - t0, **self._settle_model_axes()}
        self.last_sync = record
        if self.logger is not None:
            self.logger.log(record, step=self.step_count)
        return record

    def converge(self) -> None:
        """Average the replicas now (every rank must call it), without a meta-update,
        a new permutation or touching the interval's losses: e.g. to end a run with
        one model mid-run (:meth:`finish` ends a run with it, and a record). The
        next forward pass uses the averaged weights. Unlike :meth:`sync`
        it does not check that the ranks are at the same step: its only collectives are
        the replica-group all-reduces of the weights (model dtype, one replica group per
        shard index), which cannot carry every rank's step without changing what is
        averaged; the last :meth:`sync` checked it."""
        self.sync_obj.converge([True] * self.replicas)
        self.converged_step = self.step_count

    def replica_record(self) -> dict[str, float]:
        """Every replica's value per axis and group at the last applied step, under
        ``hdet/<axis>/replica_<r>/group_<g>`` (for logging)."""
        out = {}
        for a in sorted(self.config.axes):
            for g in self.axis_groups(a):
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
            "converged_step": self.converged_step,  # a resume at the end does not converge again
            "controller": self.controller.state_dict(),
            "auto": {"controller": self.config.auto.controller, "groups": self.config.auto.groups},
            "permutations": {k: list(v) for k, v in self.permutations.items()},
            "generator": self.generator.get_state(),
            "sync": self.sync_obj.state_dict() if self.sync_obj is not None else {},
            "config": self.config.to_dict(),  # what a resume changed is said (resume_changes)
            "peaks": list(self.peaks),  # the schedule's peak LR per group, idem
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output and re-apply the current values.

        Raises:
            HDETStateError: the state was saved with a different number of replicas or
                sync interval, or by an incompatible version.
        Warns:
            HDETResumeWarning: other ``hdet`` settings than the state was saved with
                (``resume_changes.config_changes``) or peak LR per group
                (``resume_changes.peak_changes``), each ``old -> new``.
        """
        if state.get("version") != STATE_VERSION:
            raise HDETStateError(f"HDET state version {state.get('version')} != {STATE_VERSION}")
        for key, mine in (("replicas", self.replicas), ("sync_interval", self.config.sync_interval)):
            if state[key] != mine:
                raise HDETStateError(f"checkpoint was written with hdet.{key}={state[key]} but this run has "
                                     f"hdet.{key}={mine}; resume with the same value")
        saved = state.get("auto", {})
        for key in ("controller", "groups"):
            mine = getattr(self.config.auto, key)
            if saved.get(key, mine) != mine:
                # The controllers' states mean different things (a log multiplier's velocity
                # is unitless, the paper's is an LR): never reinterpret one as the other.
                raise HDETStateError(f"checkpoint was written with hdet.auto.{key}={saved[key]!r} but this run has "
                                     f"{mine!r}; resume with the same value")
        if set(state["permutations"]) != set(self.permutations):
            raise HDETStateError("checkpoint explores different (axis, group) pairs than hdet.axes now does")
        changes = config_changes(state.get("config"), self.config.to_dict())
        changes += peak_changes(state.get("peaks"), self.peaks)
        if changes:
            warnings.warn(HDETResumeWarning("hdet: this checkpoint was written with other hdet settings or peak LR:\n  "
                                            + "\n  ".join(changes)), stacklevel=2)
        self.step_count = state["step"]
        self.sync_count = state["sync_count"]
        self.converged_step = state.get("converged_step", -1)  # absent in states saved before it
        self.controller.load_state_dict(state["controller"])
        self.permutations = {k: list(v) for k, v in state["permutations"].items()}
        self.generator.set_state(state["generator"])
        if self.sync_obj is not None and state.get("sync"):
            self.sync_obj.load_state_dict(state["sync"])
        self._apply()
