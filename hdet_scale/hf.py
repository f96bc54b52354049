"""Hugging Face ``Trainer`` integration: :class:`HDETTrainer`, one line in a standard script.

A ``Trainer`` run with ``TrainingArguments(deepspeed="ds_config.json")`` never calls
``deepspeed.initialize`` itself: Accelerate does, inside ``Trainer``'s preparation, with
the config ``Trainer`` filled (``"auto"`` values). :class:`HDETTrainer` keeps that path
and changes four things, each where ``Trainer`` offers a method to override:

* the engine: while ``Trainer`` prepares the model, the ``deepspeed.initialize`` that
  Accelerate calls gets HDET's arguments (:func:`_engine_arguments`): the shard group as
  DeepSpeed's data-parallel group (``mpu``), the :class:`~hdet_scale.ensemble.HDETScheduler`
  as its LR scheduler, the config without the ``hdet`` block and with the batch size per
  replica. Then converge, gradient sharing and warm init are attached as in
  :func:`hdet_scale.initialize`. The patch lasts only for that call (Accelerate looks the
  function up when it prepares, ``accelerator.py``: ``ds_initialize = deepspeed.initialize``).
* the loss: Accelerate's ``backward`` calls ``engine.step()`` without ``lr_kwargs``, so
  the losses ``Trainer`` hands to ``accelerator.backward`` during one optimizer step are
  summed (each is already divided for gradient accumulation, as ``Trainer`` reports
  them) and passed to the scheduler as that step's training loss on this rank.
* the schedule: ``Trainer``'s own LR scheduler would fight HDET's over the same param
  groups; :meth:`create_scheduler` returns :class:`EngineScheduler`, which leaves every
  step to the engine. ``lr_scheduler_type`` and ``warmup_*`` are therefore ignored: the
  schedule is the ``hdet.schedule`` block (``total_steps: "auto"`` takes ``Trainer``'s
  number of optimizer steps).
* checkpoints: ``save_steps`` checkpoints hold every replica's DeepSpeed state in
  ``checkpoint-N/replica_<r>/global_stepN/`` (:func:`hdet_scale.save_checkpoint`); DeepSpeed's
  own layout would have every replica write the same file names. ``train(resume_from_checkpoint=...)``
  restores them (:func:`hdet_scale.load_checkpoint`); ``Trainer`` restores its own state,
  RNG and data position as usual. The model ``save_model`` writes is replica 0's
  weights gathered to 16 bit (``stage3_gather_16bit_weights_on_model_save`` is set):
  equal to every replica's right after a converge.

On FSDP2 (the block in ``TrainingArguments.fsdp_config``) the same four changes sit
around Accelerate's FSDP2 preparation instead: :mod:`hdet_scale.hf_fsdp`.

Source: transformers 5.24 ``Trainer._prepare_for_training`` / ``training_step`` and
accelerate 1.15 ``Accelerator._prepare_deepspeed`` / ``DeepSpeedEngineWrapper.backward``;
``tests/distributed/test_hf_trainer.py`` runs it against the plain ``Trainer``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from hdet_scale import hf_fsdp, iterates
from hdet_scale.backends.common import (
    attach_sync,
    check_probe,
    check_sinks,
    make_logger,
    resolve_config,
    use_topology,
)
from hdet_scale.backends.safe_load import refuse_untrusted_trainer_files
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups
from hdet_scale.errors import HDETConfigError
from hdet_scale.hf_config import (  # noqa: F401 - resolve_auto: public here
    _checkable,
    check_deepspeed_file,
    check_run_length,
    check_trainer_values,
    explain_total_steps,
    ignored_scheduler_args,
    resolve_auto,
)
from hdet_scale.hf_deepspeed import check_partitions, zero_init  # noqa: F401 - zero_init is public here
from hdet_scale.hf_fsdp import fsdp_block
from hdet_scale.topology import Topology


class EngineScheduler:
    """``Trainer``'s ``lr_scheduler`` under HDET. On DeepSpeed the engine steps the
    :class:`HDETScheduler` inside ``engine.step``, so ``step()`` here does nothing; on
    FSDP2 ``Trainer`` calls ``step()`` after each optimizer step and it steps the
    :class:`HDETScheduler` with the step's loss (``on_step``). The LR is read from it.
    Saved and loaded empty (HDET's state travels with the checkpoint's replica folders)."""

    def __init__(self, trainer: HDETTrainer, on_step: Callable[[], None] | None = None) -> None:
        self._trainer = trainer
        self._on_step = on_step

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._on_step is not None:
            self._on_step()

    def get_last_lr(self) -> list[float]:
        scheduler = self._trainer.hdet_scheduler
        return scheduler.get_last_lr() if scheduler is not None else [0.0]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class HDETTrainer(Trainer):
    """``transformers.Trainer`` with HDET switched on by the ``"hdet"`` block of the
    DeepSpeed config given as ``TrainingArguments(deepspeed=...)``, or of
    ``TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2, "hdet": {...}})``
    for FSDP2 through Accelerate (:mod:`hdet_scale.hf_fsdp`; every key: docs/config.md).
    Without a block (or ``"enabled": false``) it is the plain ``Trainer``; without one
    (no ``"hdet"`` key, ``"hdet": null``, or neither ``deepspeed=`` nor an
    ``fsdp_config`` block) it warns so (``UserWarning``), ``"enabled": false`` is silent.

    Args:
        *args, **kwargs: ``Trainer``'s. The model is built whole on every rank
            (DeepSpeed partitions it over the shard group when training starts) or, for
            a model too large for one rank, partitioned as it is built under
            :func:`zero_init`. Either way every replica starts from replica 0's weights.
            A model that ``from_config`` / ``from_pretrained`` partitioned under
            ``Trainer``'s own ZeRO-3 (over the whole world) is refused.
        probe: ``probe(engine) -> loss`` (0-dim tensor or float, nats), as for
            :func:`hdet_scale.initialize`: needed when auto-LR is on with
            ``hdet.auto.fitness: "probe"`` (the default); with ``"train_loss"`` the step's
            training loss on each rank scores the replicas.

    ``hdet_scheduler`` (the :class:`HDETScheduler`, once training started) and
    ``hdet_topology`` (the ``R x S`` process groups) are public.

    Units: ``TrainingArguments`` counts optimizer steps (``max_steps``, ``save_steps``),
    as ``hdet.sync_interval`` does; ``per_device_train_batch_size`` is per rank, and
    DeepSpeed's ``train_batch_size`` counts all W ranks (as ``Trainer`` fills it).

    Raises (at construction, the same verdict on every rank, before any collective but
    the layout's own DeviceMesh):
        HDETConfigError: a ``TrainingArguments(deepspeed=...)`` file with a key given
            twice (:func:`hdet_scale.hf_config.check_deepspeed_file`); no ``hdet`` block
            is reachable while ``probe`` is given; an invalid ``hdet`` block or
            DeepSpeed key (all at once, as
            :func:`hdet_scale.backends.ds_prepare.prepare_config`); a ``scheduler``
            block; ``load_best_model_at_end`` (its load reads the engine's own layout); a
            missing ``probe`` where auto-LR scores by probe; on FSDP2, what
            :func:`hdet_scale.hf_fsdp.check_args` and ``check_enabled`` refuse (FSDP
            off or version 1, a ``parallelism_config``); an ``hdet`` block in
            ``fsdp_config`` while ``TrainingArguments.deepspeed`` is set (it would be
            unused); a DeepSpeed value that disagrees with ``TrainingArguments``
            (transformers' own list, which ``Trainer`` refuses only when training starts:
            :func:`hdet_scale.hf_config.check_trainer_values`); a block without
            ``schedule.total_steps`` (the message names ``"auto"``).

    Warns:
        UserWarning: no ``hdet`` block (HDET off: a plain ``Trainer`` run); ``Trainer``
            scheduler settings the block overrides; an explicit ``total_steps`` longer
            than the run.
    """

    def __init__(self, *args: Any, probe: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_deepspeed_file(training_args)  # a key twice: transformers keeps the last
        if (training_args is not None and getattr(training_args, "deepspeed", None)
                and fsdp_block(training_args) is not None):
            # the DeepSpeed config's block (or none) would be used, this one ignored
            raise HDETConfigError("TrainingArguments.fsdp_config: its 'hdet' block is unused when "
                                  "TrainingArguments.deepspeed is set (the DeepSpeed config's block, or none, "
                                  "decides); put the block in the DeepSpeed JSON, or drop deepspeed= for FSDP2")
        if (training_args is not None and getattr(training_args, "hf_deepspeed_config", None) is None
                and fsdp_block(training_args) is not None):
            hf_fsdp.check_args(training_args)  # before Trainer builds its Accelerator
        super().__init__(*args, **kwargs)
        self.hdet_scheduler: HDETScheduler | None = None
        self.hdet_topology: Topology | None = None
        self._hdet_probe = probe
        self._hdet_losses: list[torch.Tensor] = []
        self._hdet_max_steps: int | None = None
        ds = self._deepspeed_config()
        self._hdet_fsdp = ds is None and fsdp_block(self.args) is not None
        block = fsdp_block(self.args) if self._hdet_fsdp else None if ds is None else ds.get("hdet")
        self._hdet_enabled = block is not None and not (isinstance(block, dict) and block.get("enabled") is False)
        _refuse_lookalikes(ds, getattr(self.args, "fsdp_config", None))
        if not self._hdet_enabled:
            if probe is not None:
                raise HDETConfigError("HDETTrainer(probe=...): no 'hdet' block in TrainingArguments(deepspeed=...) "
                                      "or fsdp_config; add one (docs/config.md) or drop probe")
            if block is None:
                warnings.warn("HDETTrainer found no hdet block (looked in TrainingArguments.deepspeed's config and "
                              "TrainingArguments.fsdp_config): this is a plain Trainer run, HDET is off; add an "
                              "\"hdet\" block (docs/hf_trainer.md) or use transformers.Trainer", UserWarning,
                              stacklevel=2)
            return
        if self.args.load_best_model_at_end:
            raise HDETConfigError("TrainingArguments.load_best_model_at_end: not supported with an hdet block (the "
                                  "best checkpoint holds one folder per replica); set it to False")
        if self._hdet_fsdp:
            hf_fsdp.check_enabled(self)
        ignored = ignored_scheduler_args(self.args)
        if ignored is not None:
            warnings.warn(ignored, UserWarning, stacklevel=2)
        max_steps = self.args.max_steps if self.args.max_steps > 0 else None
        cfg = self._check(max_steps)
        self._hdet_block = copy.deepcopy(block)
        check_probe(cfg, probe)
        if cfg.logging.wandb.enabled and "wandb" in (self.args.report_to or []):
            # HDET's own W&B run (opened when train() builds the engine) and the Trainer's
            # WandbCallback in one process: the callback's wandb.config.update would fail
            # at on_train_begin ("You must call wandb.init() before ...")
            raise HDETConfigError("hdet.logging.wandb.enabled=true beside TrainingArguments(report_to=['wandb']): "
                                  "two W&B runs in one process, and the Trainer's callback fails at train start; "
                                  "keep one: set hdet.logging.wandb.enabled=false (HDET's records still go to "
                                  "hdet.logging.jsonl) or leave 'wandb' out of report_to")
        if "label_smoothing" in cfg.axes:
            # Trainer's loss comes from the model (or its LabelSmoother, one epsilon for all
            # ranks): a per-replica value would be silently ignored
            raise HDETConfigError("hdet.axes.label_smoothing: not applied by HDETTrainer (Trainer's loss has one "
                                  "label_smoothing_factor for every rank); explore dropout or temperature, or "
                                  "compute the loss with scheduler.model_value('label_smoothing') in your own loop")
        self.hdet_topology = build_topology(self.args)

    # ---- config ----------------------------------------------------------------------
    def _deepspeed_config(self) -> dict | None:
        """The DeepSpeed config dict ``Trainer`` and Accelerate share (``None`` without
        ``TrainingArguments(deepspeed=...)``)."""
        hf = getattr(self.args, "hf_deepspeed_config", None)
        return None if hf is None else hf.config

    def _check(self, max_steps: int | None) -> HDETConfig:
        """The config (:func:`_checkable` for a run of ``max_steps``) validated as
        :func:`hdet_scale.initialize` does: the DeepSpeed config with its block, or the
        block of ``fsdp_config``. Checked at construction and again at ``train()``: a
        warning the first check gave is not given again (else each rank prints the same
        total_steps warning twice)."""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cfg = self._check_once(max_steps)
        warned = self.__dict__.setdefault("_hdet_warned", set())
        for w in seen:
            if (w.category, str(w.message)) not in warned:
                warned.add((w.category, str(w.message)))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return cfg

    def _check_once(self, max_steps: int | None) -> HDETConfig:
        try:
            if self._hdet_fsdp:
                block = fsdp_block(self.args)
                # first: a short schedule also fails the warm-up's checks, which name no max_steps
                check_run_length(block, max_steps)
                cfg = resolve_config(_checkable({"hdet": block}, max_steps), world=self.args.world_size)
            else:
                from hdet_scale.backends.deepspeed import prepare_config

                check_trainer_values(self.args.hf_deepspeed_config)  # before HDET's batch check
                ds = self._deepspeed_config()
                block = ds.get("hdet")
                check_run_length(block, max_steps)
                cfg, _ = prepare_config(_checkable(ds, max_steps), world_size=self.args.world_size)
                check_sinks(cfg)  # the FSDP2 branch's resolve_config checks them itself
        except HDETConfigError as e:
            raise explain_total_steps(e) from None
        return cfg

    # ---- the engine ------------------------------------------------------------------
    @contextlib.contextmanager
    def _hdet_engine(self):
        """While open, ``deepspeed.initialize`` builds an HDET engine (module comment)."""
        import deepspeed

        from hdet_scale.backends.ds_cpuinfo import remember

        remember()  # before the engine loads its ops (backends/ds_cpuinfo.py)
        real = deepspeed.initialize
        # Accelerate fills "auto" values it knows and refuses others ("hdet.schedule.total_steps"):
        # the block stays out of its config while it prepares, and _initialize adds it back.
        shared = self.accelerator.state.deepspeed_plugin.deepspeed_config
        block = shared.pop("hdet", None)

        def initialize(*args: Any, **kwargs: Any):
            return self._initialize(real, *args, **kwargs)

        deepspeed.initialize = initialize
        try:
            yield
        finally:
            deepspeed.initialize = real
            if block is not None:
                shared["hdet"] = block

    def _initialize(self, real: Callable, *args: Any, **kwargs: Any):
        from hdet_scale.backends.deepspeed import DeepSpeedBackend, prepare_config

        config = kwargs.pop("config_params", None) or kwargs.pop("config", None)
        if args or config is None:
            raise RuntimeError("HDETTrainer: Accelerate called deepspeed.initialize in a way this version does not "
                               "know (positional arguments or no config); supported: accelerate 1.15 and 1.16")
        config = {**config, "hdet": self._hdet_block}  # held out of Accelerate's "auto" filling
        cfg, ds = prepare_config(resolve_auto(config, self._hdet_max_steps), world_size=self.args.world_size)
        topology = use_topology(cfg, self.hdet_topology, self.hdet_topology.mesh.device_type)
        check_partitions(kwargs.get("model"), topology)
        # DeepSpeed's fallback for a ZeRO-3 save_model writes its own checkpoint layout,
        # where every replica would write the same file names: gather the weights instead.
        ds.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
        logger = make_logger(cfg, topology, {"hdet": cfg.to_dict(), "deepspeed": ds})
        holder: dict[str, HDETScheduler] = {}

        def make_scheduler(opt: Any) -> HDETScheduler:
            holder["s"] = HDETScheduler(cfg, LiveParamGroups({topology.replica_index: opt}), logger=logger)
            return holder["s"]

        if iterates.spec_for(kwargs.get("optimizer")) is not None:
            # TrainingArguments(optim="schedule_free_adamw"): Trainer's own optimizer, which
            # ZeRO steps like any torch optimizer (and HDET's backend group by group)
            ds["zero_allow_untested_optimizer"] = True
        kwargs.update(config=ds, mpu=topology.mpu(), lr_scheduler=make_scheduler)
        engine, optimizer, loader, scheduler = real(**kwargs)
        # attach_sync first gives every replica replica 0's partitions: transformers
        # initialised a from_config model's weights on global rank 0 only
        attach_sync(scheduler, topology, DeepSpeedBackend(engine), engine, self._hdet_probe)
        self.hdet_scheduler = scheduler
        self._feed_losses(engine)
        return engine, optimizer, loader, scheduler

    def _feed_losses(self, engine: Any) -> None:
        """Hand each optimizer step's loss to the scheduler (module comment)."""
        losses = self._record_losses()
        step = engine.step

        def step_with_loss(lr_kwargs: dict | None = None) -> Any:
            if lr_kwargs is None and losses and engine.is_gradient_accumulation_boundary():
                lr_kwargs = {"loss": torch.stack(losses).sum()}
                losses.clear()
            return step(lr_kwargs=lr_kwargs)

        engine.step = step_with_loss

    def _record_losses(self) -> list[torch.Tensor]:
        """Keep every loss ``Trainer`` hands to ``accelerator.backward`` in the returned list."""
        accelerator = self.accelerator
        # a second train() on this trainer builds a new engine: wrap Accelerate's own
        # backward again, not our wrapper (each loss would be counted twice)
        backward = getattr(accelerator.backward, "_hdet_wrapped", accelerator.backward)
        losses = self._hdet_losses

        def record(loss: torch.Tensor, **kwargs: Any) -> Any:
            losses.append(loss.detach().float().reshape(()))
            return backward(loss, **kwargs)

        record._hdet_wrapped = backward
        accelerator.backward = record
        return losses

    def _fsdp_step(self) -> None:
        """FSDP2: close the optimizer step ``Trainer`` just took with its summed loss."""
        losses = self._hdet_losses
        loss = torch.stack(losses).sum() if losses else None
        losses.clear()
        self.hdet_scheduler.step(loss)

    def _get_learning_rate(self) -> float:
        """The ``learning_rate`` ``Trainer`` logs (its own method, overridden): this rank's
        replica's LR as ``Trainer`` reads it after the optimizer step (on DeepSpeed the next
        step's, since the engine stepped the scheduler; on FSDP2 the step's own); after the
        run's last step (``max_steps``) the LR that step ran with, since no step follows
        and OneCycleLR's formula one step past its end rises again (~13x the last LR).
        The scheduler's ``get_last_lr`` keeps OneCycleLR's value, as torch's
        does."""
        scheduler = self.hdet_scheduler
        if self._hdet_enabled and scheduler is not None and scheduler.step_count >= scheduler.last_step \
                and scheduler.taken_lr:
            return scheduler.taken_lr[0]
        return super()._get_learning_rate()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, then the end of every HDET run, one model
        (``HDETScheduler.finish``): when the run stopped between syncs before
        ``total_steps`` (``max_steps`` shorter than the schedule, or a callback set
        ``control.should_training_stop``, as ``EarlyStoppingCallback`` does), the
        replicas are averaged, so that the model ``train()`` leaves and ``save_model``
        writes is their average, not the replicas left apart. ``Trainer``'s
        own evaluation and checkpoint at that last step came before, and see each
        replica as at any mid-run step: a resume from that checkpoint continues the
        uninterrupted run exactly. Collective, as ``train()`` is on
        every rank."""
        out = super().train(*args, **kwargs)
        if self._hdet_enabled and self.hdet_scheduler is not None:
            self.hdet_scheduler.finish()
        return out

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluate``; refused on DeepSpeed before the first ``train()``
        (:meth:`_refuse_before_train`)."""
        self._refuse_before_train("evaluate")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict``; refused on DeepSpeed before the first ``train()``."""
        self._refuse_before_train("predict")
        return super().predict(*args, **kwargs)

    def _refuse_before_train(self, what: str) -> None:
        """On DeepSpeed, ``evaluate()`` or ``predict()`` before the first ``train()``
        builds an inference engine that ``train()`` then reuses without HDET (an
        AttributeError at ``train()``, or Accelerate's ValueError on an ``"auto"``
        total_steps; the plain Trainer fails at its first backward). Refused before
        anything is built. Raises HDETConfigError."""
        if self._hdet_enabled and not self._hdet_fsdp and self.hdet_scheduler is None:
            raise HDETConfigError(f"HDETTrainer.{what}() before train(): on DeepSpeed it builds an inference engine "
                                  "that train() would reuse without HDET (the plain Trainer then fails at its first "
                                  "backward); call train() first (TrainingArguments(eval_on_start=True) evaluates "
                                  "at its start)")

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if not self._hdet_enabled:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            self.lr_scheduler = EngineScheduler(self, self._fsdp_step if self._hdet_fsdp else None)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any):
        if not self._hdet_enabled:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self._hdet_max_steps = max_steps
        cfg = self._check(max_steps)
        self._hdet_losses.clear()
        if self._hdet_fsdp:
            return self._prepare_fsdp(cfg, max_steps, train_dataloader, resume_from_checkpoint)
        with self._hdet_engine():
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        self.hdet_scheduler.last_step = min(max_steps, self.hdet_scheduler.total_steps)  # Trainer's last step
        self._route_optimizer_modes()
        if resume_from_checkpoint is not None:
            from hdet_scale.backends.deepspeed import load_checkpoint

            refuse_untrusted_trainer_files(resume_from_checkpoint)
            load_checkpoint(self.model_wrapped, self.hdet_scheduler, resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _prepare_fsdp(self, cfg: HDETConfig, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any):
        """FSDP2: ``Trainer`` prepares on HDET's mesh, then HDET attaches
        (:mod:`hdet_scale.hf_fsdp`) and a resumed run loads every replica's folder."""
        topology = use_topology(cfg, self.hdet_topology, self.hdet_topology.mesh.device_type)
        with hf_fsdp.sharding_on(topology, cfg):
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        self.hdet_scheduler = hf_fsdp.attach(self, cfg, topology, self._hdet_probe)
        self.hdet_scheduler.last_step = min(max_steps, self.hdet_scheduler.total_steps)  # Trainer's last step
        self._route_optimizer_modes()
        self._record_losses()
        if resume_from_checkpoint is not None:
            from hdet_scale.backends.fsdp2 import load_checkpoint

            refuse_untrusted_trainer_files(resume_from_checkpoint)
            load_checkpoint(self.model_wrapped, self._inner_optimizer(), self.hdet_scheduler, resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _route_optimizer_modes(self) -> None:
        """``Trainer`` calls ``optimizer.train()`` before each training step and
        ``optimizer.eval()`` before evaluating, for schedule-free optimizers. Under ZeRO-3
        the client optimizer's groups are empty between steps, so those calls would flip
        its flags and move no weight (evaluating y, not x); route both to the scheduler's
        :meth:`~hdet_scale.ensemble.HDETScheduler.eval_mode`, which moves this rank's
        master partitions (or FSDP2 shards) and refreshes the working copy. A
        ``train()`` in train mode does nothing, so the per-step call costs nothing."""
        scheduler = self.hdet_scheduler
        if scheduler.has_eval_point():
            self.optimizer.eval, self.optimizer.train = scheduler.enter_eval_mode, scheduler.leave_eval_mode

    def _inner_optimizer(self) -> Any:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # under Accelerate's AcceleratedOptimizer

    # ---- checkpoints -----------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._hdet_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        tag = f"global_step{self.state.global_step}"
        if self._hdet_fsdp:
            from hdet_scale.backends.fsdp2 import save_checkpoint as save_fsdp

            save_fsdp(self.model_wrapped, self._inner_optimizer(), self.hdet_scheduler, output_dir, tag=tag)
            return
        from hdet_scale.backends.deepspeed import save_checkpoint

        save_checkpoint(self.model_wrapped, self.hdet_scheduler, output_dir, tag=tag)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """On FSDP2 under HDET: replica 0's weights, gathered whole (``FULL_STATE_DICT``,
        the default; every rank calls it). A checkpoint under ``SHARDED_STATE_DICT``
        writes none: its ``replica_<r>/`` folders hold every replica's shards."""
        scheduler = getattr(self, "hdet_scheduler", None) if self._hdet_enabled else None
        # schedule-free: the exported weights are the evaluation point x (the checkpoint's
        # replica folders hold y and z for the resume)
        with scheduler.eval_mode() if scheduler is not None else contextlib.nullcontext():
            self._save_model(output_dir, _internal_call)

    def _save_model(self, output_dir: str | None, _internal_call: bool) -> None:
        if not (self._hdet_enabled and self._hdet_fsdp):
            return super().save_model(output_dir, _internal_call)
        if _internal_call and "SHARDED_STATE_DICT" in hf_fsdp.state_dict_type(self):
            return None
        state = hf_fsdp.gather_replica_0(self.model_wrapped)
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)
        return None


def _refuse_lookalikes(ds: dict | None, fsdp_config: Any) -> None:
    """A top-level key that looks like ``"hdet"`` (``"hdett"``, ``"HDET"``) in the DeepSpeed
    config or ``fsdp_config``: the block would be ignored and the run plain (or Accelerate
    would stop on its ``"auto"`` values, naming no HDET key).

    Raises:
        HDETConfigError: naming the key and where it is.
    """
    from hdet_scale.ds_keys import looks_like_hdet

    for where, cfg in (("TrainingArguments(deepspeed=...)", ds), ("TrainingArguments.fsdp_config", fsdp_config)):
        bad = [k for k in cfg if looks_like_hdet(k)] if isinstance(cfg, dict) else []
        if bad:
            raise HDETConfigError(f"{where}: key {bad[0]!r} looks like the hdet block, which must be spelt 'hdet': "
                                  "as it is, HDET would be off (a plain Trainer run); rename it")


def build_topology(args: Any) -> Topology:
    """The ``R x S`` process groups for ``TrainingArguments`` ``args`` whose DeepSpeed
    config has an ``hdet`` block: built once per process for each number of replicas
    and reused by every :class:`HDETTrainer` (a DeviceMesh per trainer would add process
    groups at every ``Trainer`` built). Collective on first call.

    Raises:
        HDETConfigError: no DeepSpeed config or no ``hdet`` block in it.
    """
    hf = getattr(args, "hf_deepspeed_config", None)
    block = fsdp_block(args) if hf is None else hf.config.get("hdet")
    if not isinstance(block, dict):
        raise HDETConfigError("TrainingArguments(deepspeed=...) or fsdp_config: no 'hdet' block (docs/config.md)")
    replicas = block.get("replicas", HDETConfig().replicas)  # HDETTrainer checked the block
    cached = _TOPOLOGIES.get(replicas)
    if cached is None:
        cached = _TOPOLOGIES[replicas] = Topology(replicas, device_type=args.device.type)
    return cached


_TOPOLOGIES: dict[int, Topology] = {}
