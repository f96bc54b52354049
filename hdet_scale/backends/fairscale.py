"""fairscale backend: ``fairscale.optim.OSS`` inside each replica, torch DDP for gradients.

Layout for ``W = R x S`` ranks (see :mod:`hdet_scale.topology`):

- **OSS** shards the *optimizer state* over the S ranks of one replica (the shard group):
  each parameter tensor is owned by one shard rank, which alone keeps its Adam moments
  and updates it; after the step OSS broadcasts the updated parameters inside the shard
  group, so all S ranks of a replica hold the same full parameters.
- **torch DDP** averages gradients: over all W ranks for ``gradient_sharing: global``
  (HDET's shared gradient, paper Sec. 3.1, done by DDP itself: no HDET hook), or over the
  shard group only for ``"replica"`` (nothing crosses replicas between syncs).

HDET writes each replica's hyperparameters into ``OSS.param_groups``; OSS copies every
non-``params`` key of them into its inner per-shard optimizer at the start of each
``step`` (``OSS._sync_param_groups``, fairscale 0.4.13), so LR, weight decay and, with
``schedule.cycle_momentum``, Adam's beta1 / SGD momentum reach the update without an
adapter.

Converge (paper: average the replicas every T steps) averages, over the replica group,
only the flat buffer of the parameters this rank owns in OSS (``1/S`` of the model),
then re-broadcasts inside the shard group as OSS's own step does. That moves ``S`` times
fewer bytes across replicas than averaging full parameters on every rank, and leaves the
S ranks of a replica bit-identical by construction (one owner per tensor). OSS keeps no
separate fp32 copy of the weights (parameters are views of its flat buckets), so what
converge averages is exactly what the next forward reads.

fairscale is unmaintained since its 0.4.13 release (2022); this file reads its
``OSS.buckets`` (and each bucket's ``_params``) and calls ``OSS._broadcast_params`` (no
public API for either; checked by ``_check_oss``). Its ``FullyShardedDataParallel`` is rejected (:func:`check_fairscale_fsdp`).

Source of the method: Cheng, Huang, Zhu, Alonso, "Scalable Hyperparameter-Divergent
Ensemble Training with Automatic Learning Rate Exploration for Large Models",
arXiv 2604.24708.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from hdet_scale.backends.checkpoint_io import verify_checksums
from hdet_scale.backends.checkpoint_shapes import refuse_other_model
from hdet_scale.backends.safe_load import load as safe_load
from hdet_scale.backends.optimizer_resume import group_settings, warn_kept_settings
from hdet_scale.backends.checkpoints import (check_optimizer_class, check_resumable, checkpoint_target, finish_checkpoint, load_entries,
                                             load_hdet_state, replica_dir, save_hdet_state)
from hdet_scale.backends.common import (  # build_topology: re-exported, fairscale.build_topology(config)
    build_topology,  # noqa: F401
    use_topology,
    FullParamsBackend,
    build_scheduler,
    check_probe,
    default_device,
    init_process_group,
    make_logger,
    resolve_config,
    unwrap,
    wrap_ddp,
)
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.topology import Topology

if TYPE_CHECKING:
    from fairscale.optim import OSS

BACKEND = "fairscale"
_OSS_ATTRS = ("optim", "buckets", "rank", "group", "_broadcast_params", "_sync_param_groups", "param_groups")
# Wrappers that already own gradient reduction (and, for FSDP, the parameters): wrapping
# them again in DDP would reduce twice or see sharded placeholders.
_FOREIGN_WRAPPERS = {
    ("fairscale.", "FullyShardedDataParallel"): (
        "fairscale.nn.FullyShardedDataParallel is not supported: fairscale 0.4.13 (its last release, 2022) "
        "predates torch 2.x and its FSDP fails on current torch: the first forward raises "
        "KeyError: 'all_gather' (seen with torch 2.13 on CPU / gloo). "
        "Use hdet_scale's FSDP2 backend, PyTorch's successor to fairscale FSDP: "
        "hdet_scale.backends.fsdp2.initialize(model, config) with the unwrapped model (hdet-train: "
        "backend: fsdp2). For sharded optimizer state with full parameters, pass the unwrapped model to "
        "hdet_scale.backends.fairscale.initialize (fairscale.optim.OSS + torch DDP)."),
    ("fairscale.", "ShardedDataParallel"): (
        "fairscale.nn.ShardedDataParallel is not supported: it reduces gradients over the group of the OSS "
        "it was built with, which cannot follow hdet's replica x shard layout. Pass the unwrapped model: "
        "hdet_scale.backends.fairscale.initialize builds OSS (optimizer state sharded inside each replica) "
        "and torch DDP over the right groups itself."),
    ("torch.", "DistributedDataParallel"): (
        "the model is already wrapped in torch DistributedDataParallel; pass the unwrapped module: "
        "hdet_scale.backends.fairscale.initialize wraps it in DDP over the group that "
        "hdet.gradient_sharing needs"),
}


def _foreign_wrapper(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        for (prefix, name), message in _FOREIGN_WRAPPERS.items():
            if cls.__name__ == name and cls.__module__.startswith(prefix):
                return message
    return None


def check_fairscale_fsdp(model: nn.Module) -> None:
    """Refuse a model that holds a fairscale ``FullyShardedDataParallel`` or
    ``ShardedDataParallel`` anywhere in its module tree (or is already wrapped in torch
    DDP). Matched by class name and module (subclasses too) without importing fairscale.
    No communication, so every rank raises by itself.

    Raises:
        HDETConfigError: naming the wrapper, the module path, and the backend to use.
    """
    for path, module in model.named_modules():
        message = _foreign_wrapper(module)
        if message is not None:
            where = f"module '{path}'" if path else "the model itself"
            raise HDETConfigError(f"{where} ({type(module).__name__}): {message}")


def _check_oss(optimizer: Any) -> None:
    missing = [a for a in _OSS_ATTRS if not hasattr(optimizer, a)]
    if missing:
        import fairscale
        raise RuntimeError(f"hdet_scale needs fairscale.optim.OSS internals {missing}, absent in fairscale "
                           f"{fairscale.__version__}; supported: fairscale 0.4.13")


class OSSBackend(FullParamsBackend):
    """Local tensors of one rank under OSS + DDP (the :class:`~hdet_scale.sync.Backend`
    protocol).

    ``master_tensors()``: the flat buffer of every OSS bucket this rank owns (1-D, the
    parameters' dtype; the trainable parameters of this rank's OSS partition, whose
    ``.data`` are views of it), then every floating parameter held in no bucket (frozen
    or outside the optimizer; full). Ranks with the same shard index own the same
    partition, so the replica group all-reduces matching shapes. ``refresh()``
    broadcasts every owner's buckets inside the shard group (OSS's post-step broadcast),
    so all S ranks of a replica read the averaged full parameters in the next forward.
    ``buffers()``: this rank's persistent floating buffers (full).

    ``shares_gradients`` is true: in "global" mode DDP over the world already averages
    the gradients of all W ranks; in "replica" mode nothing is shared by design.
    """

    def __init__(self, module: nn.Module, optimizer: OSS, device: torch.device) -> None:
        super().__init__(module, device)
        _check_oss(optimizer)
        self.optimizer = optimizer

    def _owned_buckets(self) -> list[torch.Tensor]:
        # Read live: OSS rebuilds its buckets when trainability or devices change.
        return [per_rank[self.optimizer.rank].buffer for per_rank in self.optimizer.buckets.values()
                if self.optimizer.rank in per_rank]

    def _outside_buckets(self) -> list[torch.Tensor]:
        in_buckets = {id(p) for per_rank in self.optimizer.buckets.values() for bucket in per_rank.values()
                      for p in bucket._params}
        return [p.data for p in self.module.parameters() if p.is_floating_point() and id(p) not in in_buckets]

    def master_tensors(self) -> Sequence[torch.Tensor]:
        return self._owned_buckets() + self._outside_buckets()

    def noise_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For warm init (``DistributedSync.add_noise``): ``(this rank's buckets, the
        parameters in no bucket)``. The buckets partition the replica's trainable
        parameters over its S ranks (each draws its own noise, the RMS is summed over
        the shard group) and ``refresh`` broadcasts them; the rest is whole on every
        rank and must get the same noise on all of them."""
        return self._owned_buckets(), self._outside_buckets()

    @contextlib.contextmanager
    def local_optimizer(self) -> Iterator[Optimizer]:
        """The optimizer over this rank's partition (``OSS.optim``), its group values
        synced from OSS's on entry and back on exit, as ``OSS.step`` does (a value set on
        one side alone would be overwritten by the other at the next step)."""
        sync = type(self.optimizer)._sync_param_groups  # OSS is imported lazily (fairscale is optional)
        sync(self.optimizer.param_groups, self.optimizer.optim.param_groups)
        try:
            yield self.optimizer.optim
        finally:
            sync(self.optimizer.optim.param_groups, self.optimizer.param_groups)

    @torch.no_grad()
    def refresh(self) -> None:
        # S = 1: this rank owns every bucket, nothing to send (OSS would still issue a
        # broadcast per bucket on its one-rank group).
        if self.optimizer.world_size > 1:
            self.optimizer._broadcast_params()


def _check_kwargs(optim_kwargs: dict, ddp_kwargs: dict) -> None:
    owned = [f"optim_kwargs['{k}']" for k in ("group", "optim", "params") if k in optim_kwargs]
    owned += [f"ddp_kwargs['{k}']" for k in ("module", "process_group", "device_mesh") if k in ddp_kwargs]
    if owned:
        raise HDETConfigError(f"{', '.join(owned)}: set by hdet_scale from hdet.replicas and "
                              "hdet.gradient_sharing (OSS shards inside each replica; DDP spans the world or "
                              "the replica); remove them")


def initialize(model: nn.Module, config: Any, optim: type[Optimizer] = torch.optim.AdamW,
               optim_kwargs: dict | None = None, *, device: torch.device | None = None, logger: Any = None,
               ddp_kwargs: dict | None = None,
               params: Iterable[torch.Tensor] | Iterable[dict] | None = None,
               probe: Callable[[nn.Module], Any] | None = None, topology: Topology | None = None
               ) -> tuple[nn.Module, OSS, HDETScheduler]:
    """Wrap ``model`` for HDET with OSS-sharded optimizer state and torch DDP.

    Args:
        model: the unwrapped module. Its parameters and buffers are broadcast from
            global rank 0 (by DDP over the world, or explicitly in "replica" mode), so
            every replica starts from the same weights.
        config: anything :func:`~hdet_scale.backends.common.resolve_config` accepts (an
            ``HDETConfig``, the ``"hdet"`` block, a config holding one, a JSON path).
        optim: the optimizer class OSS shards (``torch.optim.AdamW``, ``SGD``...). It must
            update the parameters in place and keep no copy of them in its state.
        optim_kwargs: keyword arguments of ``optim`` (``lr`` is the peak LR unless
            ``hdet.schedule.max_lr`` is set) and of ``OSS`` (``broadcast_fp16``...).
        device: default :func:`~hdet_scale.backends.common.default_device`.
        logger: a :class:`~hdet_scale.logging.MetricsLogger`; default from ``hdet.logging``.
        ddp_kwargs: extra keyword arguments of ``DistributedDataParallel`` (see
            :func:`load_checkpoint` on ``find_unused_parameters``).
        params: parameters or parameter-group dicts of ``model`` (default: all its
            parameters, one group).
        probe: ``probe(ddp_model) -> loss``: this rank's loss on its slice of fixed probe
            batches (as in :func:`hdet_scale.backends.ddp.initialize`); needed when
            ``hdet.auto.fitness`` is ``"probe"`` (the default) and auto-LR is on.
        topology: the process groups from
            :func:`~hdet_scale.backends.common.build_topology` (same config), when the
            caller built them before the model; default: built here.

    Returns:
        ``(ddp_model, optimizer, scheduler)``: the DDP-wrapped model, the ``OSS``
        optimizer (``param_groups`` are this replica's values) and the
        :class:`~hdet_scale.ensemble.HDETScheduler`. Loop::

            loss.backward(); optimizer.step(); optimizer.zero_grad(); scheduler.step(loss)

        Gradient clipping: DDP leaves the full averaged gradient on every rank, so use
        ``torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)``, not
        ``OSS.clip_grad_norm`` (it all-reduces over the whole world, counting each
        gradient R times and mixing replicas).

    Everything that can be checked without communication is checked first, identically
    on every rank; then ``torch.distributed`` is initialised if needed (gloo on CPU, nccl
    on CUDA) and the mesh is built (collective).

    Raises:
        HDETConfigError: a fairscale FSDP / ShardedDDP or DDP-wrapped model
            (:func:`check_fairscale_fsdp`), an invalid config, or group arguments that
            hdet_scale sets itself.
    """
    from fairscale.optim import OSS

    check_fairscale_fsdp(model)
    cfg = resolve_config(config)
    check_probe(cfg, probe)
    optim_kwargs, ddp_kwargs = dict(optim_kwargs or {}), dict(ddp_kwargs or {})
    _check_kwargs(optim_kwargs, ddp_kwargs)
    device = default_device() if device is None else torch.device(device)
    init_process_group(device)
    topology = use_topology(cfg, topology, device.type)
    model = model.to(device)
    # DDP before OSS: OSS re-points each parameter's .data into its flat buckets, which
    # keeps the Parameter objects DDP registered.
    ddp_model = wrap_ddp(model, cfg, topology, device, ddp_kwargs)
    with warnings.catch_warnings():
        # fairscale 0.4 calls torch's deprecated _get_global_rank: one FutureWarning per
        # rank that the user cannot act on
        warnings.filterwarnings("ignore", message=".*_get_global_rank` is deprecated", category=FutureWarning)
        optimizer = OSS(model.parameters() if params is None else params, optim=optim, group=topology.shard_group,
                        **optim_kwargs)
    backend = OSSBackend(model, optimizer, device)
    if logger is None:
        logger = make_logger(cfg, topology, {"hdet": cfg.to_dict(), "fairscale": {
            "optim": f"{optim.__module__}.{optim.__qualname__}", "optim_kwargs": optim_kwargs}})
    # wrap_ddp broadcast global rank 0's weights to the world: the replicas start equal
    scheduler = build_scheduler(cfg, topology, optimizer, backend, logger, ddp_model, probe, start_equal=False)
    return ddp_model, optimizer, scheduler


# ---- checkpoints ----------------------------------------------------------------------
# <dir>/latest, <dir>/hdet_layout.json, and for replica r:
#   <dir>/replica_<r>/<tag>/model.pt          module state_dict (written by shard rank 0;
#                                             the S ranks of a replica hold equal params)
#   <dir>/replica_<r>/<tag>/oss_shard_<s>.pt  rank (r, s): its inner optimizer's state
#                                             (1/S of the moments), its persistent
#                                             buffers, and which parameters it owns
#   <dir>/replica_<r>/<tag>/hdet_shard_<s>.pt rank (r, s): HDET scheduler state
# Per-rank shards rather than OSS.consolidate_state_dict: that pickles and broadcasts
# every shard to one rank (full optimizer state in one process, S sequential
# broadcasts); shards are written in parallel without communication. The price, a
# resume with the same R x S and partition, is checked (layout file, owned indices).

def _owned_indices(optimizer: OSS, module: nn.Module) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(module.parameters())}
    return [[index.get(id(p), -1) for p in g["params"]] for g in optimizer.optim.param_groups]


def _buffer_state(module: nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, _ in module.named_buffers()}
    return {k: v for k, v in module.state_dict().items() if k in names}


def save_checkpoint(model: nn.Module, optimizer: OSS, scheduler: HDETScheduler, save_dir: str,
                    tag: str | None = None) -> str:
    """Save every replica's model and optimizer shards and every rank's HDET state.
    Collective (world barriers): every rank calls it after the same optimizer step.
    Returns the tag (default ``global_step<step>``, step in optimizer steps)."""
    t, tag, rdir = checkpoint_target(scheduler, save_dir, tag)
    module = unwrap(model)
    if t.shard_index == 0:
        torch.save(module.state_dict(), os.path.join(rdir, "model.pt"))
    # Buffers per rank: DDP's broadcast_buffers can be off, and even when on, a rank's
    # own forward updates its buffers after the broadcast.
    torch.save({"optimizer": optimizer.optim.state_dict(), "buffers": _buffer_state(module),
                "owned": _owned_indices(optimizer, module)}, os.path.join(rdir, f"oss_shard_{t.shard_index}.pt"))
    save_hdet_state(rdir, t, scheduler, optimizer.optim)
    finish_checkpoint(save_dir, t, scheduler, tag, BACKEND)
    return tag


def load_checkpoint(model: nn.Module, optimizer: OSS, scheduler: HDETScheduler, load_dir: str,
                    tag: str | None = None) -> str:
    """Restore what :func:`save_checkpoint` wrote into objects from :func:`initialize`
    with the same config, world size and model; returns the tag. Every rank reads its own files; the
    one collective is the verdict of the checksum check that runs first
    (``checkpoint_io.verify_checksums``, on the world group): call it on every rank. Training then continues bit for bit as if it
    had not stopped, also between two syncs, whenever DDP's group has at most 2 ranks
    (a sum of two values does not depend on its order). With more, torch DDP's own
    bucket rebuild after the first iteration of a process makes the first step after a
    resume sum the same gradients in another element order (last-bit differences, as in
    any torch DDP resume); ``ddp_kwargs={"find_unused_parameters": True}`` keeps DDP's
    buckets fixed and the resume bitwise, at the cost of one autograd-graph traversal
    per step.

    Raises:
        HDETStateError: optimizer state saved from another torch optimizer class
            (``checkpoints.check_optimizer_class``, before anything is loaded);
            no checkpoint, another ``R x S`` layout or backend (checked
            before reading any shard), a file whose bytes changed since it was written
            (its CRC), a checkpoint of another model (``checkpoint_shapes.refuse_other_model``:
            one collective, every rank raising alike), or another OSS partition
            (different parameter groups).
    """
    t = scheduler.topology
    tag = check_resumable(load_dir, t.world_size, t.replicas, BACKEND, tag)
    verify_checksums(load_dir, tag, t)
    rdir = replica_dir(load_dir, t, tag)
    check_optimizer_class(rdir, t, optimizer.optim)  # before anything is loaded
    refuse_other_model(BACKEND, load_dir, tag, rdir, {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()},
                       t)
    settings = group_settings(optimizer.optim)
    module = unwrap(model)
    device = next(module.parameters()).device
    shard = load_entries(os.path.join(rdir, f"oss_shard_{t.shard_index}.pt"), ("owned", "buffers", "optimizer"),
                         map_location=device)
    if shard["owned"] != _owned_indices(optimizer, module):
        raise HDETStateError(f"{rdir}: shard {t.shard_index} of the checkpoint owns other parameters than this "
                             "rank's OSS partition; resume with the same model and parameter groups")
    # load_state_dict copies in place, so parameters stay views of OSS's buckets.
    module.load_state_dict(safe_load(os.path.join(rdir, "model.pt"), map_location=device))
    module.load_state_dict(shard["buffers"], strict=False)
    optimizer.optim.load_state_dict(shard["optimizer"])
    # The inner groups hold the last step's values of every key; HDET re-applies its own.
    optimizer._sync_param_groups(optimizer.optim.param_groups, optimizer.param_groups)
    warn_kept_settings(settings, optimizer.optim, scheduler.config.axes)
    load_hdet_state(rdir, t, scheduler)
    return tag
