"""PyTorch FSDP2 backend: the adapter, ``initialize`` and per-replica checkpoints.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns every parameter into a DTensor
whose local shard is a dim-0 chunk of the full tensor; that local shard is what the
optimizer updates (kept in the parameter's own dtype, fp32 under a bf16
``MixedPrecisionPolicy``, which casts only the all-gathered copy). HDET converge
(paper Eq. 3) averages exactly these local shards over the replica group.

Mesh per gradient mode (``hdet.gradient_sharing``; HDET.md "Gradient sharing"):

- ``"global"`` (paper Sec. 3.1): HSDP on the 2-D ``(replica, shard)`` mesh. FSDP2
  reduce-scatters gradients inside the shard group and all-reduces them over the
  replica group, dividing by ``R x S`` in total: every replica applies the mean
  gradient of all W ranks, so the engine does the sharing (``shares_gradients``) and
  optimizer state stays identical across replicas.
- ``"replica"``: FSDP on the 1-D ``shard`` mesh. Between syncs no collective runs
  over the replica group; each replica's optimizer state diverges.

Optimizer state at converge: left alone, in both modes. Converge averages parameters
and persistent floating buffers only, as the paper's Eq. 3 and the other backends and
the simulator do. In "global" mode there is nothing to average (the moments are
identical). In "replica" mode each replica keeps its own Adam moments, as local-SGD /
DiLoCo inner optimizers do: the moments summarise the gradients *that replica's*
trajectory saw at its own step size, and their average would match no trajectory
(mean of second moments is not the second moment of the mean gradient); averaging them
would also triple converge traffic (parameters + 2 moments). Consequence: right after a
converge the replicas' weights are equal but their next updates differ even at spread 0.

Library behaviour relied on (torch 2.13, checked by tests/distributed/test_fsdp2.py):
``DTensor.to_local()`` (under ``no_grad``) aliases FSDP2's padded sharded storage, from
which every all-gather reads (casting to ``param_dtype`` each time: no cached
low-precision copy). The only copies that outlive a forward are the unsharded
parameters FSDP2 keeps on a module that does not reshard after forward, when no backward
follows (a no-grad forward: the root under FSDP2's default ``reshard_after_forward``,
every module under ``False``); ``FSDPModule.reshard`` frees them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from hdet_scale.averaging import persistent_float_buffers
from hdet_scale.backends.checkpoint_io import verify_checksums
from hdet_scale.backends.checkpoint_shapes import refuse_other_model
from hdet_scale.backends.safe_load import dcp_metadata
from hdet_scale.backends.common import build_scheduler, build_topology, check_probe, default_device, init_process_group, make_logger, resolve_config, use_topology
from hdet_scale.backends.optimizer_resume import group_settings, warn_kept_settings
from hdet_scale.backends.checkpoints import (check_optimizer_class, check_resumable, checkpoint_target, finish_checkpoint,
                                             load_hdet_state, replica_dir, save_hdet_state)
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["FSDP2Backend", "build_topology", "initialize", "load_checkpoint", "mesh_dims", "save_checkpoint"]

BACKEND_NAME = "fsdp2"


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class FSDP2Backend:
    """Local tensors of one rank of an FSDP2 model (see the module docstring).

    ``master_tensors()``: the local shards (``p.to_local()``) of the floating DTensor
    parameters, in ``model.parameters()`` order. Shapes: dim 0 is this rank's chunk of
    the full dim 0 (``ceil(n / S)`` rows on the first shards, fewer or none on the last:
    a full dim 0 of 1 or 3 over S = 2 leaves rank s = 1 with 1 row or an empty
    ``(0, ...)`` shard); other dims are full. Dtype: the parameter's own (fp32 under a
    bf16 mixed-precision policy). They are views of FSDP2's storage, so converge writes
    in place; they are read anew at every call because FSDP2's lazy initialisation may
    re-allocate an empty shard's storage.

    ``buffers()``: the persistent floating buffers, plain (unsharded) tensors on every
    rank. FSDP2 never synchronises buffers, so each rank's copy follows its own data;
    converge averages them over the replica group (like the shards): afterwards rank
    ``(r, s)`` equals rank ``(r', s)`` for every ``r'``, so the replicas are identical,
    and the differences inside a shard group are the ones plain FSDP2 would have.
    Averaging them over the whole world instead would change FSDP2's own semantics
    within a replica (and could not leave a non-finite replica out of the mean).

    ``refresh()``: :meth:`FSDPModule.reshard` on every FSDP module, dropping any
    unsharded copy left by a forward without backward, so the next forward all-gathers
    the averaged shards (and casts them to ``param_dtype``). ``master_tensors()`` calls
    it first too: while a module is unsharded its registered parameters are those full
    copies, not the DTensors.

    ``shares_gradients``: HSDP's all-reduce is the "global" mode's sharing; no hook.
    """

    # "global" mode: HSDP's all-reduce over the replica dim; "replica" mode shares nothing.
    shares_gradients = True

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device

    @torch.no_grad()
    def master_tensors(self) -> Sequence[torch.Tensor]:
        # While a module is unsharded (after a forward without backward), FSDP2 registers
        # plain full-size parameters on it; the DTensors the optimizer updates come back
        # only on reshard. Under no_grad, to_local() returns the local tensor itself (no
        # autograd view), safe to modify in place.
        self.refresh()
        return [p.to_local() if hasattr(p, "to_local") else p
                for p in self.module.parameters() if p.is_floating_point()]

    def buffers(self) -> Sequence[torch.Tensor]:
        return persistent_float_buffers(self.module)

    def noise_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The DTensors' local shards are this rank's part; nothing is whole."""
        return list(self.master_tensors()), []

    @torch.no_grad()
    def refresh(self) -> None:
        for m in _fsdp_modules(self.module):
            m.reshard()


@torch.no_grad()
def _materialize(model: nn.Module, device: torch.device, init_weights: Callable[[nn.Module], None]) -> None:
    # to_empty allocates this rank's shards (FSDP2 sharded the meta parameters without
    # touching data) but also re-allocates every buffer, dropping values that were
    # computed at construction: keep those and put them back.
    kept = {name: b.detach().to(device, copy=True) for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        if name in kept:
            b.copy_(kept[name])
    init_weights(model)


def mesh_dims(cfg: HDETConfig) -> tuple[str, ...]:
    """The dims of HDET's DeviceMesh FSDP2 shards over: ``("replica", "shard")`` (HSDP)
    for ``gradient_sharing: "global"``, ``("shard",)`` for ``"replica"``. HSDP needs a
    replica axis to all-reduce over; with R = 1 the shard mesh is the same run without a
    size-1 all-reduce."""
    return ("replica", "shard") if cfg.gradient_sharing == "global" and cfg.replicas > 1 else ("shard",)


def initialize(model: nn.Module, config: HDETConfig | Mapping[str, Any] | str | os.PathLike,
               optimizer_fn: Callable[[list[nn.Parameter]], Optimizer], *,
               shard_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
               mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool | int | None = None,
               device: torch.device | None = None, logger: Any = None,
               probe: Callable[[nn.Module], Any] | None = None, topology: Topology | None = None,
               init_weights: Callable[[nn.Module], None] | None = None
               ) -> tuple[nn.Module, Optimizer, HDETScheduler]:
    """Shard ``model`` with FSDP2 on HDET's ``(replica, shard)`` mesh and attach HDET.

    Args:
        model: the model, sharded in place. Either built with its parameters on the
            ``meta`` device (no rank ever holds the full model: the path for large
            models; ``init_weights`` then fills them after sharding), or built whole on
            CPU or on ``device``; then the ranks of one replica must build the same
            initial weights (same seed), as FSDP2 itself assumes: each rank keeps its
            own chunk of its own copy. Across replicas, every replica then takes
            replica 0's shards (one broadcast over each replica group), as DDP does.
        config: whatever :func:`~hdet_scale.backends.common.resolve_config` accepts: an
            :class:`HDETConfig`, the ``"hdet"`` block, a DeepSpeed-style dict holding
            one under ``"hdet"``, or a path to such a JSON file.
        optimizer_fn: builds the optimizer from ``list(model.parameters())`` *after*
            sharding (the parameters are DTensors then, so the optimizer state is sharded
            too).
        shard_modules: returns the submodules to ``fully_shard`` one by one (e.g. the
            transformer blocks), inner modules before the modules holding them (as
            FSDP2 requires); the root is sharded last in any case. ``None``: the root
            only (one all-gather of the whole model).
        mp_policy: FSDP2 ``MixedPrecisionPolicy`` (e.g. ``param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32``); the sharded parameters, which the optimizer
            updates and converge averages, stay in their own dtype.
        reshard_after_forward: passed to ``fully_shard`` for every module; ``None`` is
            FSDP2's own default (reshard every module but the root, whose parameters
            backward needs at once). Any value works with converge (see
            :class:`FSDP2Backend`).
        device: default :func:`~hdet_scale.backends.common.default_device`.
        logger: a :class:`~hdet_scale.logging.MetricsLogger`; default: built from
            ``hdet.logging`` (global rank 0 writes).
        probe: ``probe(model) -> loss`` (0-dim tensor or float, nats): this rank's loss
            on its slice of fixed probe batches (shard rank s of every replica the same
            slice s), run under ``torch.no_grad`` at each auto-LR sync before converge;
            the replica's fitness is the mean over its S ranks. Needed when
            ``hdet.auto.fitness`` is ``"probe"`` (the default) and auto-LR is on.
        topology: the process groups from :func:`build_topology` (same config), when
            the caller built them first; default: built here.
        init_weights: ``init_weights(model)``, called under ``torch.no_grad`` after
            ``fully_shard`` and ``model.to_empty(device=device)`` when ``model`` has
            parameters on the meta device (required then, ignored otherwise). It must
            write every parameter's local shard (``p.to_local()`` of the DTensor; its
            place in the full tensor: ``torch.distributed.tensor._utils.
            compute_local_shape_and_global_offset``) and any buffer left on the meta
            device; buffers built off the meta device (e.g. RoPE tables) are kept as
            they were (``to_empty`` would drop them). Replica r > 0's values are then
            replaced by replica 0's (the replicas start as copies of one model).

    Returns:
        ``(model, optimizer, scheduler)``. The loop: ``loss.backward();
        optimizer.step(); optimizer.zero_grad(); scheduler.step(loss)`` on every rank at
        every optimizer step, ``loss`` being this rank's local loss.

    The config is checked before ``torch.distributed`` is touched (initialised from the
    launcher's environment if needed), identically on every rank.

    Raises:
        HDETConfigError: an invalid config, ``hdet.enabled`` false, ``hdet.replicas``
            not dividing the world size, a ``topology`` of another layout, or a model
            on the meta device without ``init_weights`` (all before any collective).
    """
    from torch.distributed.fsdp import fully_shard

    cfg = resolve_config(config)
    check_probe(cfg, probe)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and init_weights is None:
        raise HDETConfigError("init_weights: the model has parameters on the meta device; pass "
                              "init_weights(model) to fill their shards after sharding")
    device = torch.device(device) if device is not None else default_device()
    init_process_group(device)
    topology = use_topology(cfg, topology, device.type)
    mesh = topology.mesh[mesh_dims(cfg)]
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if not on_meta:
        model.to(device)
    if shard_modules is not None:
        for sub in shard_modules(model):
            if sub is not model:
                fully_shard(sub, **kwargs)
    fully_shard(model, **kwargs)
    if on_meta:
        _materialize(model, device, init_weights)
    optimizer = optimizer_fn(list(model.parameters()))
    backend = FSDP2Backend(model, device)
    logger = logger if logger is not None else make_logger(cfg, topology)
    scheduler = build_scheduler(cfg, topology, optimizer, backend, logger, model, probe)
    return model, optimizer, scheduler


# ---- checkpoints ----------------------------------------------------------------------
# Layout: <dir>/latest, <dir>/hdet_layout.json, and per replica r one PyTorch Distributed
# Checkpoint (DCP) in <dir>/replica_<r>/<tag>/ (.metadata, __<s>_0.distcp written by the
# S ranks of its shard group) plus hdet_shard_<s>.pt (the HDET state of rank (r, s)).
#
# DCP de-duplicates what it sees as replicated (a DTensor's Replicate placement, plain
# tensors, non-tensor values) across the ranks of its process group and writes it once.
# Replicas differ between syncs (weights, and in "replica" mode optimizer state), so one
# DCP over the world would keep one replica only: each replica saves its own DCP on its
# shard group instead, where every DTensor local shard is distinct. Buffers are plain
# tensors that FSDP2 does not synchronise, so they may differ on every rank: they are
# stored under a per-rank key (``buffers_shard_<s>``) that DCP cannot merge.

def _split_model_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(parameters, buffers)`` of the sharded model state dict (DTensors, plain
    tensors), by fully qualified name; both alias the model's storage."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model)
    buffer_names = {n for n, _ in model.named_buffers()}
    params = {k: v for k, v in sd.items() if k not in buffer_names}
    buffers = {k: v for k, v in sd.items() if k in buffer_names}
    return params, buffers


def _state(model: nn.Module, optimizer: Optimizer, shard_index: int, with_optimizer: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params, buffers = _split_model_state(model)
    state = {"model": params, f"buffers_shard_{shard_index}": buffers}
    if with_optimizer:
        # On an optimizer without state this takes one step with zero gradients and lr 0
        # (torch's _init_optim_state): the parameters keep their values, the state is
        # then overwritten by the checkpoint's.
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_checkpoint(model: nn.Module, optimizer: Optimizer, scheduler: HDETScheduler, save_dir: str,
                    tag: str | None = None) -> str:
    """Save every replica's model shards, buffers and optimizer state, and every rank's
    HDET state (including the loss accumulated since the last sync, so a run stopped
    mid-interval resumes exactly). Collective: every rank calls it at the same step,
    between optimizer steps. Returns the tag (default ``global_step<step>``)."""
    import torch.distributed.checkpoint as dcp

    t, tag, rdir = checkpoint_target(scheduler, save_dir, tag)
    # Before the first optimizer step there is no optimizer state, and reading it through
    # torch's state-dict API would create some (a zero step: Adam's step counter 1),
    # changing the run that saves. Such a checkpoint holds no optimizer entry instead.
    with_optimizer = bool(optimizer.state)
    dcp.save(_state(model, optimizer, t.shard_index, with_optimizer), checkpoint_id=rdir,
             process_group=t.shard_group)
    save_hdet_state(rdir, t, scheduler, optimizer)
    finish_checkpoint(save_dir, t, scheduler, tag, BACKEND_NAME)
    return tag


def load_checkpoint(model: nn.Module, optimizer: Optimizer, scheduler: HDETScheduler, load_dir: str,
                    tag: str | None = None) -> str:
    """Restore what :func:`save_checkpoint` wrote into an engine built by
    :func:`initialize` with the same config, world size and model; returns the tag.
    Collective on each shard group (every rank calls it).

    Raises:
        HDETStateError: optimizer state saved from another torch optimizer class
            (``checkpoints.check_optimizer_class``, before anything is loaded);
            no checkpoint, another ``R x S`` layout or backend, or a missing
            replica folder (all checked before any collective, identically on every rank).
            Then a file of the replica's folder whose bytes changed since it was written
            (its CRC-32s, ``checkpoint_io.verify_checksums``: one collective on the world
            group, every rank raising alike, before anything is loaded). Then a
            checkpoint of another model: tensors of another shape, missing or extra
            (``checkpoint_shapes.agreed_difference``: one more collective, every rank
            raising alike, before anything is loaded).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    t = scheduler.topology
    tag = check_resumable(load_dir, t.world_size, t.replicas, BACKEND_NAME, tag)
    verify_checksums(load_dir, tag, t)
    rdir = replica_dir(load_dir, t, tag)
    check_optimizer_class(rdir, t, optimizer)  # before anything is loaded
    settings = group_settings(optimizer)
    # DCP loads the keys it is asked for: a smaller model would load from a larger
    # checkpoint without a word
    params, _ = _split_model_state(model)
    refuse_other_model(BACKEND_NAME, load_dir, tag, rdir, {k: tuple(v.shape) for k, v in params.items()}, t)
    saved_keys = dcp_metadata(rdir).state_dict_metadata
    with_optimizer = any(k.startswith("optim.") for k in saved_keys)
    state = _state(model, optimizer, t.shard_index, with_optimizer)
    dcp.load(state, checkpoint_id=rdir, process_group=t.shard_group)
    set_model_state_dict(model, {**state["model"], **state[f"buffers_shard_{t.shard_index}"]})
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        optimizer.state.clear()  # saved before the first step: start the moments afresh
    warn_kept_settings(settings, optimizer, scheduler.config.axes)
    # Last: re-applies this replica's hyperparameters over the param groups just loaded.
    load_hdet_state(rdir, t, scheduler)
    return tag
