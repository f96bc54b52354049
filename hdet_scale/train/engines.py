"""The trainer's engines: one per backend, behind the same few calls, so the loop in
``loop.py`` is one code path for DeepSpeed ZeRO-3, FSDP2, DDP and fairscale OSS.

Every backend reads its settings from the run's ``deepspeed`` section (the DeepSpeed
JSON with its ``hdet`` block): DeepSpeed reads all of it; the other backends read the
keys ``optimizer.type``, ``optimizer.params``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``train_batch_size``, ``gradient_clipping`` and
``bf16.enabled`` (same meaning as in DeepSpeed) and ignore the rest
(``zero_optimization``, ``steps_per_print``...), so one file describes the run for
every backend; except DeepSpeed-only keys that move memory or change precision (CPU
offload, ZeRO++ quantization, autocast), which they refuse, and a ZeRO stage that they
shard otherwise than, which gets a note (:func:`engine_notes`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hdet_scale.backends import BACKENDS
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError
from hdet_scale.train.memory import peak_host_mb
from hdet_scale.train.model import (ModelConfig, apply_activation_checkpointing, build_model, init_model_weights,
                                    loss_fn, param_count)
# Re-exported: the loop, the CLI and hdet-dryrun import them from here.
from hdet_scale.engine_config import (OPTIMIZERS, ZERO_EQUIVALENT, axis_bases, check_engine_config,  # noqa: F401
                                     engine_notes, optimizer_class_name)


class Engine:
    """The model of ``mcfg`` built for ``backend`` (sharded as it is built when
    ``mcfg.sharded_init``, on deepspeed and fsdp2) and trained through
    :func:`hdet_scale.prepare`: the same calls on every engine."""

    #: Backward passes and input tokens (positions) this rank has run, counted where they
    #: happen (``micro_step``): the trainer logs them, so accumulation that runs a batch
    #: twice, or k x k backward passes per step, shows.
    backward_passes = 0
    tokens = 0

    def __init__(self, backend: str, mcfg: ModelConfig, run: dict, logger: Any, probe: Any = None) -> None:
        from hdet_scale.api import prepare
        from hdet_scale.backends.common import default_device

        ds = run["deepspeed"]
        self.backend = backend
        from hdet_scale.backends.common import world_size
        from hdet_scale.ds_values import batch_sizes

        self.micro_batch = batch_sizes(ds, world_size())[0]  # derived as DeepSpeed does when left out
        options: dict[str, Any] = {}
        topology = None
        if backend == "deepspeed":
            from hdet_scale.backends.deepspeed import build_topology, zero_init

            # The layout first, then the model partitioned over its shard group as it is
            # built (model.sharded_init): no rank ever holds the whole model.
            topology = build_topology(ds)
            with zero_init(topology, ds) if mcfg.sharded_init else contextlib.nullcontext():
                model = apply_activation_checkpointing(build_model(mcfg), mcfg)
        else:
            device = default_device()
            options["device"] = device
            # fsdp2 with model.sharded_init: parameters on the meta device, sharded, then
            # each rank draws its own shard (the whole build's values; train/init.py).
            # ddp and fairscale hold the whole model on every rank.
            meta = backend == "fsdp2" and mcfg.sharded_init
            model = apply_activation_checkpointing(build_model(mcfg, params_on_meta=meta), mcfg)
            if backend == "fsdp2":
                options["shard_modules"] = lambda m: m.model.layers
                if meta:
                    options["init_weights"] = lambda m: init_model_weights(m, mcfg)
            else:
                model = model.to(device)
        # The construction's peak; a meta-device build allocates later, inside prepare
        # (to_empty), and the engine's own peak follows in the summary.
        self.model_built_mb = peak_host_mb()
        self.ens = prepare(model, ds, backend=backend, logger=logger, probe=probe, topology=topology, **options)
        self.model, self.optimizer, self.scheduler = self.ens.model, self.ens.optimizer, self.ens.scheduler
        self.grad_accum = self.ens.grad_accum
        self.device = self.model.device if backend == "deepspeed" else options["device"]
        self._module = self.model.module if backend in ("deepspeed", "ddp", "fairscale") else self.model

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        """One micro-batch's forward and backward; ``last``: the step's last one (then
        :meth:`step` follows)."""
        assert last == self.ens.sync_gradients, "the loop and the ensemble count micro-batches alike"
        with self.ens.accumulate():
            loss = loss_fn(self.model, inputs, targets, self._label_smoothing())
            self.ens.backward(loss)
        self.backward_passes += 1
        self.tokens += inputs.numel()
        if not last:
            self.ens.step()  # DeepSpeed counts accumulation boundaries by these calls
        return loss.detach()

    def _label_smoothing(self) -> float:
        """This replica's ``hdet.axes.label_smoothing`` value this step (0 without the axis)."""
        axes = self.scheduler.config.axes
        return self.scheduler.model_value("label_smoothing") if "label_smoothing" in axes else 0.0

    def step(self, loss: torch.Tensor) -> None:
        """The optimizer and HDET step; ``loss`` (the loop's mean of the step's
        micro-batch losses) equals what the ensemble recorded and hands the scheduler."""
        self.ens.step()

    def eval(self) -> None:
        self.ens.eval()

    def train(self) -> None:
        self.ens.train()

    def save(self, path: str) -> None:
        self.ens.save_checkpoint(path)

    def load(self, path: str) -> None:
        import warnings

        from hdet_scale.errors import HDETResumeWarning

        with warnings.catch_warnings():
            # hdet-train's own notice (resume_config.notice) lists every changed setting,
            # these included, once, before any rank starts
            warnings.simplefilter("ignore", HDETResumeWarning)
            self.ens.load_checkpoint(path)

    def param_count(self) -> int:
        return param_count(self._module)


def build_engine(backend: str, mcfg: ModelConfig, run: dict, hcfg: HDETConfig, logger: Any,
                 probe: Any = None):
    """The engine of ``backend`` (one of :data:`BACKENDS`) with the model of ``mcfg``
    built inside it (sharded as it is built when ``mcfg.sharded_init``, on deepspeed and
    fsdp2); ``probe`` is handed to the backend's ``initialize`` (auto-LR fitness)."""
    if backend not in BACKENDS:
        raise HDETConfigError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return Engine(backend, mcfg, run, logger, probe)
