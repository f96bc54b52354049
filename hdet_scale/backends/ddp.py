"""Plain PyTorch DDP backend: ``initialize`` for an ``R x S`` world and per-replica
checkpoints. The paper's drop-in scheduler on DDP is ``hdet_scale.reference.OneCycleAutoLR``.

Every rank holds the full model (:class:`~hdet_scale.backends.common.FullParamsBackend`),
so converge is a bucketed mean all-reduce of the parameters and persistent floating
buffers over the replica group, written straight into what the next forward reads.

Gradient sharing is DDP's own all-reduce, on the group ``hdet.gradient_sharing`` names:

- ``"global"``: DDP over the whole world. Its all-reduce averages the gradients of all W
  ranks, so every replica applies the same gradient with its own LR (paper Sec. 3.1).
- ``"replica"``: DDP over the shard group; gradients stay inside the replica between
  syncs (local-SGD style). With ``S = 1`` a comm hook keeps each gradient local, so
  nothing is all-reduced at all.

Method: Cheng, Huang, Zhu, Alonso, "Scalable Hyperparameter-Divergent Ensemble Training
with Automatic Learning Rate Exploration for Large Models", arXiv 2604.24708.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from hdet_scale.backends.checkpoint_io import verify_checksums
from hdet_scale.backends.checkpoint_shapes import MODEL_FILE, refuse_other_model
from hdet_scale.backends.common import FullParamsBackend, build_scheduler, build_topology, check_probe, default_device, init_process_group, make_logger, resolve_config, unwrap, use_topology, wrap_ddp
from hdet_scale.backends.optimizer_resume import group_settings, warn_kept_settings
from hdet_scale.backends.checkpoints import check_optimizer_class, load_entries, check_resumable, checkpoint_target, finish_checkpoint, load_hdet_state, replica_dir, save_hdet_state
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETConfigError
from hdet_scale.topology import Topology

__all__ = ["build_topology", "initialize", "load_checkpoint", "save_checkpoint"]


# ---- initialize -----------------------------------------------------------------------

def initialize(model: torch.nn.Module, config: HDETConfig | Mapping[str, Any] | str | os.PathLike,
               optimizer_fn: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], *,
               device: torch.device | None = None, logger: Any = None, ddp_kwargs: dict | None = None,
               probe: Callable[[Any], Any] | None = None, topology: Topology | None = None
               ) -> tuple[DistributedDataParallel, torch.optim.Optimizer, HDETScheduler]:
    """Wrap ``model`` in DDP for an ``R x S`` HDET world and build its scheduler.

    Args:
        model: the full model (every rank holds all of it); moved to ``device``.
        config: anything :func:`~hdet_scale.backends.common.resolve_config` accepts: an
            :class:`HDETConfig`, an ``"hdet"`` block, a dict holding one, or a JSON path.
            ``replicas`` is R; ``S = W / R`` ranks form each shard group (replica).
        optimizer_fn: ``(params) -> Optimizer``, called once with
            ``list(model.parameters())`` (close over ``model`` to build parameter groups).
            Its groups' ``lr`` are the peak LRs when ``hdet.schedule.max_lr`` is null.
        device: default :func:`~hdet_scale.backends.common.default_device`
            (``cuda:$LOCAL_RANK``, else CPU). ``torch.distributed`` is initialised from
            the launcher's environment if nobody did (nccl on CUDA, gloo on CPU).
        logger: a :class:`~hdet_scale.logging.MetricsLogger`; default built from
            ``hdet.logging`` (global rank 0 writes).
        ddp_kwargs: extra ``DistributedDataParallel`` arguments (not ``process_group``:
            ``hdet.gradient_sharing`` chooses it).
        probe: ``probe(ddp_model) -> loss`` (0-dim tensor or float, nats): this rank's
            loss on its slice of fixed probe batches (shard rank s of every replica the
            same slice s), run under ``torch.no_grad`` at each auto-LR sync before
            converge; the replica's fitness is the mean over its S ranks. Needed when
            ``hdet.auto.fitness`` is ``"probe"`` (the default) and auto-LR is on.
        topology: the process groups from
            :func:`~hdet_scale.backends.common.build_topology` (same config), when the
            caller built them before the model; default: built here.

    Returns:
        ``(ddp_model, optimizer, scheduler)``. Drive it as usual and pass the loss to the
        scheduler: ``loss.backward(); optimizer.step(); scheduler.step(loss)``.

    Every rank starts from global rank 0's parameters and buffers. Collective: every
    rank calls it.

    Raises:
        HDETConfigError: an invalid config (before any collective), or one that does not
            fit the optimizer (a ``max_lr`` list of the wrong length, a group without the
            explored hyperparameter): still before the first collective, on every rank.
    """
    cfg = resolve_config(config)
    check_probe(cfg, probe)
    ddp_kwargs = dict(ddp_kwargs or {})
    if "process_group" in ddp_kwargs:
        raise HDETConfigError("ddp_kwargs.process_group: chosen by hdet.gradient_sharing ('global': the world, "
                              "'replica': the shard group); remove it")
    device = torch.device(device) if device is not None else default_device()
    init_process_group(device)
    model.to(device)
    optimizer = optimizer_fn(list(model.parameters()))
    # The scheduler's own checks against the optimizer, run here without a sync so that a
    # mismatch fails on every rank before the mesh below issues its first collective.
    HDETScheduler.check_param_groups(cfg, optimizer.param_groups)
    topology = use_topology(cfg, topology, device.type)
    ddp_model = wrap_ddp(model, cfg, topology, device, ddp_kwargs)
    if logger is None:
        logger = make_logger(cfg, topology)
    # wrap_ddp broadcast global rank 0's weights to the world: the replicas start equal
    scheduler = build_scheduler(cfg, topology, optimizer, FullParamsBackend(model, device), logger, ddp_model, probe,
                                start_equal=False)
    return ddp_model, optimizer, scheduler


# ---- checkpoints ----------------------------------------------------------------------
# <dir>/replica_<r>/<tag>/model_optim.pt (written by replica r's shard rank 0: every rank
# of a DDP replica holds the same model and optimizer state) and hdet_shard_<s>.pt (the
# scheduler state of rank (r, s): its own interval-loss accumulator), plus rank 0's
# hdet_layout.json and latest.

def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: HDETScheduler,
                    save_dir: str, tag: str | None = None) -> str:
    """Save every replica's model and optimizer and every rank's HDET state. Collective:
    all ranks call it at the same step (mid-interval too: replicas' diverged weights are
    kept). ``model`` may be the DDP wrapper; the plain module's ``state_dict`` is saved.
    Returns the tag (default ``global_step<step>``)."""
    t, tag, rdir = checkpoint_target(scheduler, save_dir, tag)
    if t.shard_index == 0:
        torch.save({"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(rdir, MODEL_FILE))
    save_hdet_state(rdir, t, scheduler, optimizer)
    finish_checkpoint(save_dir, t, scheduler, tag, "ddp")
    return tag


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: HDETScheduler,
                    load_dir: str, tag: str | None = None) -> str:
    """Restore what :func:`save_checkpoint` wrote into this rank's replica; returns the tag.
    Every rank calls it; it issues no collective, and the layout is checked before
    anything is read. Continuing is bitwise identical to not stopping (mid-interval too)
    whenever DDP's group has at most 2 ranks (a sum of two values does not depend on its
    order). With more, torch DDP rebuilds its gradient buckets after the first iteration
    of a process, so the first step after a resume sums the same gradients in another
    element order (last-bit differences, ~1e-8, as in any torch DDP resume);
    ``ddp_kwargs={"find_unused_parameters": True}`` keeps the buckets fixed and the
    resume bitwise, at the cost of one autograd-graph traversal per step.

    Raises:
        HDETStateError: optimizer state saved from another torch optimizer class
            (``checkpoints.check_optimizer_class``, before anything is loaded);
            no checkpoint, or one written by another ``R x S`` layout or
            another backend.
            Then a file of the replica's folder whose bytes changed since it was written
            (its CRC-32s, ``checkpoint_io.verify_checksums``: one collective on the world
            group, every rank raising alike, before anything is loaded). Then a checkpoint of another model (tensors of
            another shape, missing or extra: ``checkpoint_shapes.refuse_other_model``,
            one more collective, every rank raising alike, before anything is loaded).
    """
    t = scheduler.topology
    tag = check_resumable(load_dir, t.world_size, t.replicas, "ddp", tag)
    verify_checksums(load_dir, tag, t)
    rdir = replica_dir(load_dir, t, tag)
    check_optimizer_class(rdir, t, optimizer)  # before anything is loaded
    module = unwrap(model)
    refuse_other_model("ddp", load_dir, tag, rdir, {k: tuple(v.shape) for k, v in module.state_dict().items()}, t)
    settings = group_settings(optimizer)
    device = next(module.parameters()).device
    state = load_entries(os.path.join(rdir, MODEL_FILE), ("model", "optimizer"), map_location=device)
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    warn_kept_settings(settings, optimizer, scheduler.config.axes)
    load_hdet_state(rdir, t, scheduler)
    return tag
