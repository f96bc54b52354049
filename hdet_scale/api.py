"""One API for every engine: :func:`prepare` returns an :class:`Ensemble` whose few calls
are the same on DeepSpeed ZeRO-3, FSDP2, DDP and fairscale OSS, so one training loop runs
on all four::

    ens = hdet_scale.prepare(model, "ds_config.json", backend="fsdp2", probe=probe)
    for batch in loader:                       # micro-batches of this rank
        with ens.accumulate():                 # gradient all-reduce on a step's last micro-batch only
            loss = compute_loss(ens.model, batch)
            ens.backward(loss)
        ens.step()                             # after every micro-batch; updates on every k-th
    ens.save_checkpoint("ckpt/")               # the same arguments and result on every engine

The config is the DeepSpeed-style JSON with its ``hdet`` block for every engine (as
``hdet-train``): DeepSpeed reads all of it; the others read ``optimizer.type`` /
``optimizer.params`` (AdamW, Adam or SGD), ``gradient_accumulation_steps``,
``gradient_clipping`` (default 1.0, as DeepSpeed) and ``bf16.enabled`` (FSDP2), and refuse
DeepSpeed-only keys that would change memory or precision
(:func:`hdet_scale.engine_config.check_engine_config`).

It is a thin layer on each backend's own ``initialize`` / ``save_checkpoint`` /
``load_checkpoint`` (still public for what it does not cover); ``hdet-train`` trains
through it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from hdet_scale.backends import BACKENDS
from hdet_scale.errors import HDETConfigError, HDETStateError

__all__ = ["Ensemble", "prepare"]


def _optimizer_parts(ds: dict) -> tuple[type, dict]:
    """``(torch optimizer class, its arguments)`` from the config's ``optimizer`` block."""
    from hdet_scale.engine_config import OPTIMIZERS, optimizer_class_name

    opt = ds["optimizer"]
    kwargs = dict(opt.get("params", {}) or {})
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return OPTIMIZERS[optimizer_class_name(opt["type"])], kwargs


def _load(config: Any) -> dict:
    from hdet_scale.backends.ds_prepare import load_ds_config as _load_ds_config

    try:
        return _load_ds_config(config)
    except HDETConfigError:
        raise
    except ValueError as e:  # the JSON parser's words name no file
        raise HDETConfigError(f"DeepSpeed config {os.fspath(config)!r} is not valid JSON: {e}") from None


PREPARED = "_hdet_prepared"  # the attribute a prepared model carries: the backend's name


def prepare(model: torch.nn.Module, config: str | dict, *, backend: str = "deepspeed",
            optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, probe: Callable[[Any], Any] | None = None,
            topology: Any = None, logger: Any = None, **options: Any) -> "Ensemble":
    """HDET on ``backend`` for ``model``, from the DeepSpeed-style ``config`` (a JSON path
    or a dict, with its ``"hdet"`` block).

    Args:
        model: built whole on every rank, or sharded as it is built: under
            ``hdet_scale.zero_init(topology, config)`` (deepspeed) or on the meta device
            with ``init_weights=`` in ``options`` (fsdp2); pass that ``topology``.
        backend: ``"deepspeed"`` (ZeRO-3), ``"fsdp2"``, ``"ddp"`` or ``"fairscale"``.
        optimizer: ``params -> torch.optim.Optimizer``, for a config without an
            ``optimizer`` block; default: that block (DeepSpeed builds its own from it).
            Not for fairscale, whose OSS takes the block's class and arguments.
        probe: ``probe(model) -> loss`` for auto-LR's probe fitness (as each backend's
            ``initialize``: this rank's loss on its slice of fixed probe batches).
        topology, logger: as each backend's ``initialize``.
        **options: the backend's own options (fsdp2: ``shard_modules``, ``mp_policy``,
            ``init_weights``...; ddp / fairscale: ``ddp_kwargs``; ``device``).

    Returns:
        An :class:`Ensemble`.

    Raises:
        HDETConfigError: an unknown backend, an invalid config (every problem at once,
            before any collective, the same on every rank), ``optimizer=`` with
            fairscale, beside the config's ``optimizer`` block, or not a function (an
            optimizer instance), a model built under
            ``zero_init`` for a backend other than ``"deepspeed"``, a model prepared
            already (it carries ``_hdet_prepared``, set here on success).
    """
    if backend not in BACKENDS:
        raise HDETConfigError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if optimizer is not None and (isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer)):
        # an optimizer instance would be a TypeError ("'AdamW' object is not callable")
        raise HDETConfigError(f"optimizer: expected a function params -> torch.optim.Optimizer, e.g. lambda params: "
                              f"torch.optim.AdamW(params, lr=1e-3), got {type(optimizer).__name__!r} "
                              "(the engine builds it over the parameters it wraps, FSDP2's shards)")
    ds = _load(config)
    if optimizer is not None and ds.get("optimizer") is not None:
        # optimizer= would win silently over the block (its type, LR, betas);
        # Accelerate refuses the same pair ("cannot specify an optimizer in the config
        # file and in the code at the same time")
        block = ds["optimizer"]
        what = block.get("type", "?") if isinstance(block, dict) else type(block).__name__
        raise HDETConfigError(f"optimizer: the config's \"optimizer\" block ({what}) and optimizer= both give the "
                              "optimizer; remove the block to build your own, or leave out optimizer= to use it")
    if getattr(model, PREPARED, None) is not None:
        # two engines and two HDET schedulers would drive one set of parameters
        raise HDETConfigError(f"model: already prepared by hdet_scale.prepare (backend="
                              f"{getattr(model, PREPARED)!r}); a second prepare would wrap the same parameters in a "
                              "second engine and HDET scheduler: prepare a model once and use the Ensemble returned")
    if backend != "deepspeed" and any(hasattr(p, "ds_id") for p in model.parameters()):
        # a model built under zero_init would pass, and the first forward fail inside
        # DeepSpeed's partitioned linear ("mat2 must be a matrix") on every rank
        raise HDETConfigError(f"model: its parameters are partitioned by DeepSpeed (built under "
                              f"hdet_scale.zero_init), which only backend='deepspeed' takes; for backend={backend!r} "
                              "build it normally" + (", or sharded under torch.device('meta') with shard_modules= "
                                                     "and init_weights=" if backend == "fsdp2" else ""))
    if backend == "deepspeed":
        from hdet_scale.backends.deepspeed import initialize

        opt = None if optimizer is None else optimizer(model.parameters())
        engine, _, _, scheduler = initialize(model, ds, optimizer=opt, probe=probe, topology=topology,
                                             logger=logger, **options)
        setattr(model, PREPARED, backend)
        return Ensemble("deepspeed", engine, engine.optimizer, scheduler,
                        engine.gradient_accumulation_steps(), clip=0.0)
    from hdet_scale.backends.common import resolve_config, world_size
    from hdet_scale.ds_keys import check_deepspeed_keys
    from hdet_scale.ds_values import check_client_optimizer, check_deepspeed_values
    from hdet_scale.engine_config import check_engine_config

    # As the deepspeed backend and hdet-train do (unchecked, a negative
    # gradient_clipping runs unclipped, an "hdet_config" block is ignored, a text LR
    # raises a TypeError after torch.distributed has started). The torch optimizer's
    # own arguments are checked against its signature by check_engine_config.
    check_deepspeed_keys(ds, optimizer_params=False)
    check_deepspeed_values(ds)
    check_client_optimizer(ds, optimizer)  # neither a block nor optimizer= (not "got None")

    # an optimizer= of the user's stands in for the config's block in the engine checks
    check_engine_config(ds if optimizer is None else {**ds, "optimizer": {"type": "AdamW"}}, backend,
                        world_size(), prefix="")
    hcfg = resolve_config(ds)
    user_model = model  # marked as prepared once its engine is built (the wrapper is another module)
    cls, cls_kwargs = _optimizer_parts(ds) if optimizer is None else (None, {})
    make = optimizer or (lambda params: cls(params, **cls_kwargs))
    kw = dict(logger=logger, probe=probe, topology=topology, **options)
    if backend == "fsdp2":
        from hdet_scale.backends import fsdp2

        if "mp_policy" not in kw and (ds.get("bf16") or {}).get("enabled") is True:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model, opt, scheduler = fsdp2.initialize(model, hcfg, make, **kw)
    elif backend == "ddp":
        from hdet_scale.backends import ddp

        model, opt, scheduler = ddp.initialize(model, hcfg, make, **kw)
    else:
        from hdet_scale.backends import fairscale

        if optimizer is not None:
            raise HDETConfigError("optimizer: fairscale's OSS builds the optimizer itself from a class and its "
                                  "arguments; set the config's optimizer block (type, params) instead")
        model, opt, scheduler = fairscale.initialize(model, hcfg, cls, cls_kwargs, **kw)
    # DeepSpeed's default (GRADIENT_CLIPPING_DEFAULT = 1.0 in 0.19): the same key means
    # the same clipping on every backend.
    from hdet_scale.backends.common import world_size
    from hdet_scale.ds_values import batch_sizes

    setattr(user_model, PREPARED, backend)
    # the accumulation a config leaves out, derived as DeepSpeed does (train_batch_size and the micro-batch)
    return Ensemble(backend, model, opt, scheduler, batch_sizes(ds, world_size())[1],
                    clip=float(ds.get("gradient_clipping", 1.0)))


class Ensemble:
    """This rank's part of an HDET run, behind the same calls on every engine.

    Attributes:
        backend: ``"deepspeed"``, ``"fsdp2"``, ``"ddp"`` or ``"fairscale"``.
        model: what the forward pass runs on (the DeepSpeed engine, the FSDP2 module,
            the DDP wrapper).
        optimizer, scheduler: the engine's optimizer and the
            :class:`~hdet_scale.ensemble.HDETScheduler` (``scheduler.topology``: the
            ``R x S`` process groups; shard the data over all W of its ranks).
        grad_accum: micro-batches per optimizer step (``gradient_accumulation_steps``).
    """

    def __init__(self, backend: str, model: Any, optimizer: Any, scheduler: Any, grad_accum: int,
                 clip: float) -> None:
        self.backend, self.model, self.optimizer, self.scheduler = backend, model, optimizer, scheduler
        self.grad_accum = int(grad_accum)
        self._clip = clip
        self._micro = 0  # micro-batches since the last optimizer step
        self._loss = 0.0  # their losses' sum
        self._backward_done = False  # a backward since the last step() call
        if scheduler is not None:
            scheduler.driver = "the Ensemble of hdet_scale.prepare (ens.step())"

    @property
    def topology(self) -> Any:
        return self.scheduler.topology

    @property
    def sync_gradients(self) -> bool:
        """True while the micro-batch to come is the last of its optimizer step."""
        return self._micro == self.grad_accum - 1

    def accumulate(self) -> Any:
        """Context for one micro-batch's forward and backward: the engine's gradient
        all-reduce runs on the step's last micro-batch only (DDP / fairscale
        ``no_sync``, FSDP2 ``set_requires_gradient_sync``; DeepSpeed decides itself)."""
        last = self.sync_gradients
        if self.backend == "deepspeed" or last and self.backend != "fsdp2":
            return contextlib.nullcontext()
        if self.backend == "fsdp2":
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (its mean, a 0-dim tensor in nats); the
        gradient of the step is the mean over its micro-batches on every engine
        (DeepSpeed divides by the accumulation steps itself, the others here). The
        loss is recorded for the scheduler.

        Raises:
            TypeError: ``loss`` is not a tensor (a float from ``loss.item()``).
            HDETConfigError: a second backward before :meth:`step` (a step() every
                other micro-batch would run half the optimizer steps, each on a
                gradient twice the mean, without a word).
        """
        if self._backward_done:
            raise HDETConfigError("Ensemble.backward: called again before step(); call ens.step() after every "
                                  "micro-batch's backward (it counts the micro-batches and updates on every k-th, "
                                  f"k = gradient_accumulation_steps = {self.grad_accum}); for several losses of one "
                                  "micro-batch, backward their sum")
        if not isinstance(loss, torch.Tensor):  # not "'float' has no attribute 'backward'"
            raise TypeError(f"Ensemble.backward: loss must be the micro-batch's loss tensor (0-dim, with its graph), "
                            f"got {type(loss).__name__} {loss!r:.60}; pass the tensor, not loss.item()")
        self._backward_done = True
        if self.backend == "deepspeed":
            self.model.backward(loss)
        else:
            (loss / self.grad_accum).backward()
        self._loss = self._loss + loss.detach()

    def step(self) -> bool:
        """Call after every micro-batch's :meth:`backward`. On the step's last one:
        clip (``gradient_clipping``), step the optimizer, zero the gradients and step
        the HDET scheduler with the step's loss (the micro-batches' mean): converge every
        ``sync_interval`` steps and at ``hdet.schedule.total_steps`` (the run ends with
        one model), auto-LR. A non-finite gradient norm skips the update and
        still counts the step, on every engine. Returns whether this was a step's last
        micro-batch.

        Raises:
            HDETConfigError: no :meth:`backward` since the last call (a second step()
                per micro-batch would make every other update one with no gradient
                and a recorded loss of 0, auto-LR's fitness).
            ValueError: the step would pass ``hdet.schedule.total_steps``
                (``HDETScheduler.check_can_step``), raised before the optimizer steps, so
                the weights stay those of the last valid step.
        """
        if not self._backward_done:
            raise HDETConfigError("Ensemble.step: no backward since the last step(); call ens.backward(loss) once "
                                  "per micro-batch, then ens.step() once")
        self._refuse_in_eval_mode("step")
        if self._micro + 1 == self.grad_accum:
            # before any engine moves a weight (else DeepSpeed and the torch engines
            # step the optimizer, then the scheduler refuses the step)
            self.scheduler.check_can_step()
        self._backward_done = False
        self._micro += 1
        last = self._micro == self.grad_accum
        if not last:
            if self.backend == "deepspeed":
                self.model.step()  # DeepSpeed counts the accumulation boundary by these calls
            return False
        loss = self._loss / self.grad_accum
        self._micro, self._loss = 0, 0.0
        self.scheduler.driver_stepping = True  # the one step() of this scheduler per optimizer step
        try:
            if self.backend == "deepspeed":
                self.model.step(lr_kwargs={"loss": loss})
            else:
                from hdet_scale.backends.torch_step import optimizer_step

                optimizer_step(self.model.parameters(), self.optimizer, self.scheduler, loss, self._clip)
        finally:
            self.scheduler.driver_stepping = False
        return True

    def _refuse_mid_step(self, call: str, why: str) -> None:
        """Raise HDETStateError when micro-batches of an optimizer step are pending (a
        backward since the last step boundary). Every rank counts the same micro-batches,
        so every rank raises alike, before any collective."""
        if self._micro or self._backward_done:
            pending = self._micro + (1 if self._backward_done else 0)
            raise HDETStateError(f"Ensemble.{call}: called after {pending} of the {self.grad_accum} micro-batches of "
                                 f"optimizer step {getattr(self.scheduler, 'step_count', 0) + 1} "
                                 f"(gradient_accumulation_steps): {why} when ens.step() returned True (the step's "
                                 "last micro-batch)")

    def _refuse_in_eval_mode(self, call: str) -> None:
        """Raise HDETStateError between :meth:`eval` and :meth:`train` when the optimizer
        moved the parameters to its evaluation point: a step would train from there, a
        checkpoint would hold it instead of the training point. Every rank alike."""
        if self.scheduler is not None and self.scheduler.holds_eval_point:
            raise HDETStateError(f"Ensemble.{call}: the parameters hold the optimizer's evaluation point (ens.eval() "
                                 "on a schedule-free optimizer); call ens.train() first")

    def converge(self) -> None:
        """Average the replicas now, between optimizer steps: one model from here on (e.g.
        a loop that stops before ``hdet.schedule.total_steps``, where :meth:`step`
        converges by itself; ``scheduler.finish()`` does the same and logs it). No meta-update, no new permutation; the next step's LRs
        stay the replicas' own. Collective: every rank calls it at the same step.

        Raises:
            HDETStateError: called in the middle of an optimizer step, before any
                collective (every rank counts the same micro-batches).
        """
        self._refuse_mid_step("converge", "the replicas' pending gradients would be applied to the average; converge")
        self.scheduler.converge()

    def train(self) -> None:
        """The module in train mode, and the parameters back at the optimizer's training
        point when :meth:`eval` had moved them (schedule-free's y)."""
        if self.scheduler is not None:
            self.scheduler.leave_eval_mode()
        self.model.train()

    def eval(self) -> None:
        """The module in eval mode and, for an optimizer with an evaluation point
        (schedule-free AdamW: its averaged iterate x, :mod:`hdet_scale.iterates`), the
        parameters moved there until :meth:`train`, as Hugging Face's Trainer does around
        evaluation. Evaluate and export the model in between; checkpoints hold the
        training point, so call :meth:`train` before :meth:`save_checkpoint`. Collective
        on the shard group for sharded engines (every rank calls it)."""
        self.model.eval()
        if self.scheduler is not None:
            self.scheduler.enter_eval_mode()

    def _backend(self) -> Any:
        import importlib

        return importlib.import_module(f"hdet_scale.backends.{self.backend}")

    def save_checkpoint(self, save_dir: str, tag: str | None = None) -> str:
        """Every replica's weights and optimizer state and every rank's HDET state under
        ``save_dir`` (atomic: ``latest`` moves last); between optimizer steps. Collective:
        every rank calls it at the same step. Returns the tag (default
        ``global_step<step>``).

        Raises:
            HDETStateError: called in the middle of an optimizer step (after a micro-batch
                that was not its step's last), before anything is written: the pending
                micro-batches' gradients are no part of a checkpoint, and a resume from it
                would drop them silently. Every rank counts the
                same micro-batches, so every rank raises alike.
        """
        self._refuse_mid_step("save_checkpoint", "their gradients are in no checkpoint; save")
        self._refuse_in_eval_mode("save_checkpoint")
        lib = self._backend()
        if self.backend == "deepspeed":
            return lib.save_checkpoint(self.model, self.scheduler, save_dir, tag)
        return lib.save_checkpoint(self.model, self.optimizer, self.scheduler, save_dir, tag)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Restore what :meth:`save_checkpoint` wrote (same config, world and model);
        training then continues as if it had not stopped. Returns the tag loaded.

        Raises:
            HDETStateError: no checkpoint, another layout or engine, a file changed since
                it was written (every rank alike, before anything is loaded); called in
                the middle of an optimizer step (the pending micro-batches' gradients
                would be carried into the loaded state's next step).
        """
        self._refuse_mid_step("load_checkpoint", "their gradients would be added to the loaded state's next step; "
                                                 "load")
        lib = self._backend()
        if self.backend != "deepspeed":
            return lib.load_checkpoint(self.model, self.optimizer, self.scheduler, load_dir, tag)
        # DeepSpeed's load returns its client state, not the tag: resolve the tag first
        from hdet_scale.backends.checkpoints import check_resumable

        t = self.scheduler.topology
        tag = check_resumable(load_dir, t.world_size, t.replicas, self.backend, tag)
        lib.load_checkpoint(self.model, self.scheduler, load_dir, tag)
        return tag
