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
import os
from typing import Any

import torch

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError
from hdet_scale.backends import BACKENDS
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError, HDETStateError
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
        """Load the checkpoint ``latest`` names in ``path``. First the model tensors its
        files hold (names and shapes, read without their data) are compared with the model
        this run built: a checkpoint of another model (a ``model.*`` setting changed while
        the settings comparison before the start was skipped) is an
        :class:`~hdet_scale.errors.HDETStateError` on every rank alike (one collective
        agrees on it), naming the folder and the first differing tensors. Without it
        DDP, fairscale and DeepSpeed failed in every rank with torch's state-dict traceback
        (ZeRO-3, for another width: a bare tensor-size error of its flat optimizer
        partitions), and FSDP2 loaded a smaller model from a larger checkpoint silently."""
        import warnings

        from hdet_scale.errors import HDETResumeWarning

        self._refuse_other_model(path)
        try:
            with warnings.catch_warnings():
                # hdet-train's own notice (resume_config.notice) lists every changed setting,
                # these included, once, before any rank starts
                warnings.simplefilter("ignore", HDETResumeWarning)
                self.ens.load_checkpoint(path)
        except HDETStateError:
            raise
        except RuntimeError as e:
            # what the comparison could not read (no shapes in the files) and the engine's
            # strict load still finds; any other RuntimeError is not a mismatch: re-raised
            if not str(e).startswith("Error(s) in loading state_dict"):
                raise
            lines = [line.strip() for line in str(e).splitlines()[1:3] if line.strip()]
            raise HDETStateError(_other_model_message(path, "; ".join(line[:300] for line in lines))) from None

    def _refuse_other_model(self, path: str) -> None:
        """Raise HDETStateError on every rank when the checkpoint's model tensors differ
        from this run's (``checkpoint_shapes.shape_difference``). Collective on the world group: every
        rank calls it, so one rank that could not read its files (it then leaves them to
        the load, which names a damaged file) never waits alone in the load's collectives."""
        from hdet_scale.backends.checkpoint_io import read_latest
        from hdet_scale.backends.checkpoint_shapes import agreed_difference

        t = self.scheduler.topology
        tag = read_latest(path)
        folder = os.path.join(path, f"replica_{t.replica_index}", tag) if tag is not None else None
        difference = agreed_difference(self.backend, folder, self._built_shapes(), t)
        if difference:
            raise HDETStateError(_other_model_message(path, difference))

    def _built_shapes(self) -> dict[str, tuple[int, ...]]:
        """This run's model tensors, ``{name: full shape}``, named as the backend's save
        names them (``checkpoint_shapes.saved_model_shapes``)."""
        if self.backend == "fsdp2":
            from hdet_scale.backends.fsdp2 import _split_model_state

            params, _ = _split_model_state(self.model)  # what its save hands DCP under "model."
            return {k: tuple(v.shape) for k, v in params.items()}  # a DTensor's shape is the full one
        if self.backend == "deepspeed":  # ZeRO-3 partitions: ds_shape is the full shape
            return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in self._module.named_parameters()}
        return {k: tuple(v.shape) for k, v in self._module.state_dict().items()}

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


# ---- a checkpoint of another model -----------------------------------------------------
# hdet-train refuses a changed model.* setting before any rank starts, from the settings
# each save records (resume_config.py). A record without the tag (written as {"runs": {}}
# to resume on purpose without the comparison, or a checkpoint older than the record)
# skips that; the ranks then compare the tensors themselves before the engine's load.

def _other_model_message(path: str, difference: str) -> str:
    """The refusal of a checkpoint whose model tensors differ from this run's model:
    where, how, and the likely cause, read from the settings record of the tag."""
    from hdet_scale.backends.checkpoint_io import read_latest
    from hdet_scale.train.resume_config import RECORD_FILE

    tag = read_latest(path)
    record = os.path.join(path, RECORD_FILE)
    try:
        with open(record) as f:
            recorded = tag in json_load(f).get("runs", {})
    except (OSError, ValueError, AttributeError, TypeError):
        recorded = False
    if recorded:
        cause = (f"Its model.* settings recorded in {record} are this run's, so its model files are not the ones "
                 "that run saved (copied in from another run?): restore them, or start a new run_dir")
    else:
        cause = ("Likely a model.* setting (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, "
                 "tie_embeddings) differs from the run that saved it: the comparison of settings before a resume "
                 f"was skipped, as {record} holds no record of {tag} (it was replaced by {{\"runs\": {{}}}}, or the "
                 "checkpoint is older than the record). Resume with that run's model.* settings, or start a new "
                 "run_dir")
    return (f"train.resume: the checkpoint {path}/replica_*/{tag} holds another model than this run builds: "
            f"{difference}. {cause}")
