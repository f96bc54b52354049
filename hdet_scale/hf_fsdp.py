"""FSDP2 through Accelerate for :class:`~hdet_scale.hf.HDETTrainer`: HDET's mesh, engine and checkpoints.

A ``Trainer`` run with ``TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2,
...})`` shards the model in Accelerate (``Accelerator._prepare_fsdp2`` ->
``fsdp2_prepare_model``: ``fully_shard`` per transformer block, embeddings, tail and
root, activation checkpointing, mixed precision, the optimizer's parameters swapped for
the DTensors). HDET keeps all of that and changes the mesh only: while ``Trainer``
prepares, :func:`sharding_on` hands ``fsdp2_prepare_model`` a view of the accelerator
whose device mesh is HDET's ``(replica, shard)`` mesh, so FSDP2 shards inside each
replica's shard group exactly as :func:`hdet_scale.backends.fsdp2.initialize` does:

* ``gradient_sharing: "global"`` (the default, paper Sec. 3.1): HSDP on the 2-D mesh;
  FSDP2 reduce-scatters over the shard group and all-reduces over the replica group.
  This is Accelerate's own ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)``
  layout, without its restriction ``S > 1`` and with HDET's process groups.
* ``"replica"``: FSDP2 on the 1-D shard mesh; no collective runs over the replica group
  between syncs.

Then :func:`attach` builds the :class:`~hdet_scale.ensemble.HDETScheduler` over the
optimizer ``Trainer`` made, on :class:`~hdet_scale.backends.fsdp2.FSDP2Backend` (converge
averages the local shards over the replica group), after every replica took replica 0's
shards. Checkpoints are :func:`hdet_scale.backends.fsdp2.save_checkpoint`'s per-replica
DCP folders; the model ``save_model`` writes is replica 0's, gathered whole
(:func:`gather_replica_0`).

Accelerate 1.15 turns its FSDP plugin on for GPU-type runs only (``AcceleratorState``:
``MULTI_CPU`` never becomes ``FSDP``), although FSDP2 runs on gloo; the CPU test
(tests/distributed/test_hf_fsdp.py) sets the plugin Accelerate would have set on GPUs.

Source: accelerate 1.15 ``utils/fsdp_utils.py`` (``fsdp2_prepare_model`` reads the mesh
as ``accelerator.torch_device_mesh[accelerator.parallelism_config.fsdp_dim_names]``),
transformers 5.24 ``Trainer._prepare_for_training`` / ``save_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from hdet_scale.backends.common import attach_sync, make_logger
from hdet_scale.backends.fsdp2 import FSDP2Backend, mesh_dims
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups
from hdet_scale.errors import HDETConfigError
from hdet_scale.topology import Topology


def fsdp_block(args: Any) -> Any:
    """The ``"hdet"`` entry of ``TrainingArguments.fsdp_config`` (``None`` without one)."""
    fsdp_config = getattr(args, "fsdp_config", None)
    return fsdp_config.get("hdet") if isinstance(fsdp_config, dict) else None


def check_args(args: Any) -> None:
    """Refuse, before ``Trainer`` builds its ``Accelerator``, what FSDP2-HDET cannot run
    (read from ``args`` only: every rank alike).

    Raises:
        HDETConfigError: an ``hdet`` block in ``fsdp_config`` without ``fsdp`` set, an
            ``fsdp_config.version`` other than 2, or a ``parallelism_config`` (HDET
            builds the ``R x S`` mesh itself).
    """
    if not getattr(args, "fsdp", None):
        raise HDETConfigError("TrainingArguments.fsdp_config has an 'hdet' block but fsdp is not set; set "
                              "fsdp=\"full_shard\" (or move the block to a DeepSpeed config): HDET would be off")
    version = args.fsdp_config.get("version", 2)
    if str(version) != "2":
        raise HDETConfigError(f"fsdp_config.version: {version!r}; the hdet block needs FSDP2 (version 2)")
    if getattr(args, "parallelism_config", None) is not None:
        raise HDETConfigError("TrainingArguments.parallelism_config: not supported with an hdet block; HDET builds "
                              "the replica x shard mesh from hdet.replicas (leave it unset)")


def check_enabled(trainer: Any) -> None:
    """Refuse a ``Trainer`` whose ``Accelerator`` runs without FSDP although ``fsdp`` is set.

    Raises:
        HDETConfigError: Accelerate did not enable its FSDP plugin (accelerate 1.15 does
            on GPU-type runs only): HDET would be off.
    """
    if not trainer.is_fsdp_enabled:
        raise HDETConfigError("TrainingArguments.fsdp: set, but Accelerate runs without FSDP (accelerate 1.15-1.16 enable "
                              "their FSDP plugin on GPUs only); with the hdet block in fsdp_config HDET would be off")


class _OnHDETMesh:
    """The accelerator as ``fsdp2_prepare_model`` reads it, with HDET's mesh and dims."""

    def __init__(self, accelerator: Any, mesh: Any, dims: tuple[str, ...]) -> None:
        self._accelerator = accelerator
        self.torch_device_mesh = mesh
        self.parallelism_config = SimpleNamespace(fsdp_dim_names=dims)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


@contextlib.contextmanager
def sharding_on(topology: Topology, cfg: HDETConfig):
    """While open, Accelerate's FSDP2 preparation shards on HDET's mesh (module comment).
    Accelerate calls ``fsdp2_prepare_model`` through its module's global name, so the
    patch of that name lasts exactly as long as ``Trainer`` prepares."""
    import accelerate.accelerator as accelerator_module

    real = accelerator_module.fsdp2_prepare_model
    dims = mesh_dims(cfg)

    def prepare(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
        return real(_OnHDETMesh(accelerator, topology.mesh, dims), model)

    accelerator_module.fsdp2_prepare_model = prepare
    try:
        yield
    finally:
        accelerator_module.fsdp2_prepare_model = real


def attach(trainer: Any, cfg: HDETConfig, topology: Topology, probe: Callable[[Any], Any] | None
           ) -> HDETScheduler:
    """The scheduler over ``trainer``'s prepared optimizer, with converge on the FSDP2
    model; :func:`~hdet_scale.backends.common.attach_sync` first gives every replica
    replica 0's shards. Collective (replica group, then warm init's shard group)."""
    model = trainer.model_wrapped
    optimizer = trainer._inner_optimizer()
    backend = FSDP2Backend(model, trainer.args.device)
    fsdp = {k: v for k, v in trainer.args.fsdp_config.items() if k != "hdet"}
    logger = make_logger(cfg, topology, {"hdet": cfg.to_dict(), "fsdp": fsdp})
    scheduler = HDETScheduler(cfg, LiveParamGroups({topology.replica_index: optimizer}), logger=logger)
    attach_sync(scheduler, topology, backend, model, probe, optimizer=optimizer)
    return scheduler


def gather_replica_0(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Replica 0's full weights on global rank 0 (CPU, each tensor its own storage; other
    ranks get ``{}``). Collective: FSDP2 all-gathers each parameter over the shard group
    (the replica dim of HSDP is replicated: nothing crosses it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # On CPU, cpu_offload returns the gathered tensors themselves, whose storage FSDP2
    # frees at the next reshard; safetensors then fails. Own copies, as on GPU.
    return {k: v.clone() for k, v in state.items()}


def state_dict_type(trainer: Any) -> str:
    return str(getattr(trainer.accelerator.state.fsdp_plugin, "state_dict_type", ""))
