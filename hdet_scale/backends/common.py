"""What every backend shares: config resolution before any collective, the scheduler and
sync wiring, and the adapter for engines that hold full parameters (DDP, fairscale OSS).
The checkpoint layout they share is ``backends/checkpoints.py``.

Each engine file (``ddp.py``, ``fsdp2.py``, ``fairscale.py``, ``deepspeed.py``) only says
where its local tensors live and how it shares gradients; the HDET arithmetic is
:class:`~hdet_scale.ensemble.HDETScheduler` for all of them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError
from hdet_scale import iterates
from hdet_scale.averaging import _buckets, persistent_float_buffers
from hdet_scale.config import BLOCK_EXAMPLE, HDETConfig
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups, check_config
from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import check_output_file, require_regular
from hdet_scale.probe import require_probe
from hdet_scale.sync import DistributedSync
from hdet_scale.topology import Layout, Topology


def world_size() -> int:
    """``torch.distributed`` world size, else ``$WORLD_SIZE``, else 1 (no communication)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_config(config: HDETConfig | Mapping[str, Any] | str | os.PathLike, world: int | None = None
                   ) -> HDETConfig:
    """Parse and check an HDET config for a world of ``world`` ranks, without communication
    (so every rank reaches the same verdict before the first collective).

    Args:
        config: an :class:`HDETConfig`; a mapping that is either the ``"hdet"`` block or a
            whole DeepSpeed-style config holding one under ``"hdet"``; or a path to such a
            JSON file.
        world: W (default: :func:`world_size`).

    Raises:
        HDETConfigError: a mapping with DeepSpeed keys but no ``"hdet"`` block; an invalid block, ``hdet.enabled`` false (these backends have no
            plain mode of their own: spread 0 with auto-LR off is plain data
            parallelism), ``replicas`` not dividing W, or a derived decay outside [0, 1).
    """
    if isinstance(config, (str, os.PathLike)):
        require_regular(config, "hdet config")
        with open(config) as f:
            config = json_load(f)
    if isinstance(config, Mapping):
        if "hdet" not in config:
            from hdet_scale.ds_keys import valid_top_level_keys

            # a DeepSpeed config without the block must not be read as the block itself,
            # its keys called unknown hdet keys
            ds_like = sorted(str(k) for k in config if k in valid_top_level_keys())
            if ds_like:
                raise HDETConfigError(f"hdet config: a DeepSpeed-style config (keys {', '.join(ds_like[:4])}"
                                      f"{', ...' if len(ds_like) > 4 else ''}) without an \"hdet\" block: add one, "
                                      f"e.g. {BLOCK_EXAMPLE} (docs/config.md), or pass the hdet block itself")
        config = HDETConfig.from_dict(config["hdet"] if "hdet" in config else config)
    if not isinstance(config, HDETConfig):
        raise HDETConfigError(f"hdet config: expected an HDETConfig, a dict or a JSON path, got {type(config)}")
    if not config.enabled:
        raise HDETConfigError("hdet.enabled: false; this backend runs HDET only (for plain data parallelism "
                              "set axes.lr.spread_ratio=0 and auto.enabled=false, or do not use hdet_scale)")
    Layout(world_size() if world is None else world, config.replicas)
    check_config(config)
    check_sinks(config)
    return config


def check_sinks(config: HDETConfig) -> None:
    """``hdet.logging``'s sinks, on every rank before any collective, where rank 0 alone
    would fail later: a JSONL path it could not open at its first record
    (:func:`~hdet_scale.paths.check_output_file`), W&B settings it could not start.
    :func:`resolve_config`, the DeepSpeed backend's ``initialize`` and ``HDETTrainer``
    call it (else ``HDETTrainer`` on DeepSpeed trains into an ``IsADirectoryError`` on
    rank 0 at step 1).

    Raises:
        HDETConfigError: naming the key.
    """
    if not config.enabled:
        return
    if config.logging.jsonl:
        check_output_file(config.logging.jsonl, "hdet.logging.jsonl")
    if config.logging.wandb.enabled:
        from hdet_scale.logging import check_wandb_settings

        check_wandb_settings(config.logging.wandb, prefix="hdet.logging.wandb.")


def make_logger(cfg: HDETConfig, topology: Topology, run_config: dict | None = None) -> Any:
    """The :class:`~hdet_scale.logging.MetricsLogger` of ``hdet.logging`` (writing on
    global rank 0), or ``None`` when no sink is configured."""
    if not (cfg.logging.jsonl or cfg.logging.wandb.enabled):
        return None
    from hdet_scale.logging import MetricsLogger

    return MetricsLogger(cfg.logging.jsonl, cfg.logging.wandb, run_config or {"hdet": cfg.to_dict()},
                         enabled=topology.rank == 0)


def check_probe(cfg: HDETConfig, probe: Any) -> None:
    """A backend's ``probe=`` argument (``probe(model) -> loss``) against the config,
    before any collective (:func:`hdet_scale.probe.require_probe`)."""
    require_probe(cfg, probe, "probe", "probe(model) -> loss", 1)


@torch.no_grad()
def start_from_replica_0(backend: Any, topology: Topology) -> None:
    """Every replica takes replica 0's local tensors: each rank (r, s) gets the fp32
    master shard and buffers of rank (0, s) (one broadcast per tensor over the replica
    group; a few flat tensors on DeepSpeed), then refreshes its working copy. HDET's
    replicas start as copies of one model (paper Sec. 3.1); DDP and fairscale broadcast
    at wrap, but DeepSpeed broadcasts only inside its data-parallel group (the shard
    group) and FSDP2 not at all, so ranks seeded apart, or an ``init_weights`` that
    differs between replicas, would start the replicas apart, unsaid.
    Collective on the replica groups; nothing with one replica."""
    if topology.replicas == 1:
        return
    src = dist.get_global_rank(topology.replica_group, 0)
    # frozen parameters: outside DeepSpeed's master partitions (its backend lists them)
    frozen = list(getattr(backend, "frozen_tensors", list)())
    for t in list(backend.master_tensors()) + list(backend.buffers()) + frozen:
        dist.broadcast(t, src=src, group=topology.replica_group)
    backend.refresh()


def attach_sync(scheduler: HDETScheduler, topology: Topology, backend: Any, model: Any, probe: Any,
                start_equal: bool = True, optimizer: Any = None) -> None:
    """Attach this rank's :class:`~hdet_scale.sync.DistributedSync` (installs the
    gradient-sharing hook), bind the model-side axes and ``probe`` to ``model`` (the object the user's forward
    runs on: the DeepSpeed engine, the FSDP2 / DDP module), and apply the warm noisy
    initialisation when configured. ``start_equal``: first give every replica replica
    0's weights (:func:`start_from_replica_0`; false where the engine's wrap already
    broadcast them over the world). ``optimizer``: the torch optimizer over the
    backend's master tensors, for a backend without ``local_optimizer()`` (DDP, FSDP2):
    an optimizer with several iterates (schedule-free) is put in train mode, and
    converge and the probe handle its iterates (:mod:`hdet_scale.iterates`). Collective
    (the replica groups, then warm init's shard group)."""
    cfg = scheduler.config
    if start_equal:
        start_from_replica_0(backend, topology)
    if model is not None:
        scheduler.bind_model(model)  # model-side axes (dropout, temperature) reach this rank's module
    local = getattr(backend, "local_optimizer", None) or (lambda: contextlib.nullcontext(optimizer))
    with local() as opt:
        if opt is not None:
            iterates.train_mode_(opt)  # schedule-free optimizers start in eval mode and refuse to step there
            msg = iterates.schedule_warning(opt, cfg.schedule.name)
            if msg:
                warnings.warn(msg, UserWarning, stacklevel=3)
    scheduler.attach(DistributedSync(topology, backend, cfg.bucket_bytes, cfg.gradient_sharing,
                                     cfg.overlap_gradient_sharing, local_optimizer=local))
    scheduler.set_probe(None if probe is None else (lambda: probe(model)))
    scheduler.warm_init()


def build_scheduler(cfg: HDETConfig, topology: Topology, optimizer: Any, backend: Any,
                    logger: Any = None, model: Any = None, probe: Any = None,
                    start_equal: bool = True) -> HDETScheduler:
    """The scheduler of this rank (its replica's param groups, read live) with its
    :class:`~hdet_scale.sync.DistributedSync` attached (:func:`attach_sync`)."""
    scheduler = HDETScheduler(cfg, LiveParamGroups({topology.replica_index: optimizer}), logger=logger)
    attach_sync(scheduler, topology, backend, model, probe, start_equal, optimizer)
    return scheduler


def default_device() -> torch.device:
    """``cuda:$LOCAL_RANK`` when CUDA is there, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_topology(config: HDETConfig | Mapping[str, Any] | str | os.PathLike,
                   device: torch.device | str | None = None) -> Topology:
    """The process groups of the ``R x S`` layout, built *before the model*, so that the
    model can be constructed sharded over the shard group (FSDP2 on the meta device,
    :func:`hdet_scale.backends.deepspeed.zero_init`) and handed to ``initialize(...,
    topology=...)`` with the same groups.

    Args:
        config: whatever :func:`resolve_config` accepts.
        device: the device type of the mesh (default :func:`default_device`; ``cuda``
            binds this process to ``cuda:$LOCAL_RANK`` first).

    The config is checked first, without communication, identically on every rank; then
    ``torch.distributed`` is initialised from the launcher's environment if needed (nccl
    on CUDA, gloo on CPU) and the DeviceMesh is built. Collective: every rank calls it.

    Raises:
        HDETConfigError: an invalid config or ``replicas`` not dividing the world size.
    """
    cfg = resolve_config(config)
    device = torch.device(device) if device is not None else default_device()
    init_process_group(device)
    return Topology(cfg.replicas, device_type=device.type)


def use_topology(cfg: HDETConfig, topology: Topology | None, device_type: str) -> Topology:
    """``topology`` (from :func:`build_topology`) checked against ``cfg``, or a new one.
    The check reads only the topology's sizes, the same on every rank, so a mismatch
    fails everywhere before the next collective.

    Raises:
        HDETConfigError: ``topology`` has another number of replicas than ``hdet.replicas``.
    """
    if topology is None:
        return Topology(cfg.replicas, device_type=device_type)
    if not isinstance(topology, Topology) or topology.replicas != cfg.replicas:
        got = topology.replicas if isinstance(topology, Topology) else type(topology).__name__
        raise HDETConfigError(f"topology: built for {got} replicas but hdet.replicas={cfg.replicas}; build it "
                              "from the same config (build_topology(config))")
    return topology


def init_process_group(device: torch.device) -> None:
    """``init_process_group`` from the launcher's environment if nobody did (nccl on CUDA,
    gloo on CPU), and bind this process to its CUDA device first."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from hdet_scale.backends.rendezvous import joining

    with joining():  # a peer that never joins: said every minute; Ctrl-C / SIGTERM end the wait
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _keep_local_gradients(_state, bucket):  # no annotations: DDP checks them against its own types
    # DDP comm hook for a shard group of one rank: the bucket already holds this rank's
    # full gradient; returning it skips the all-reduce call entirely.
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, group: Any, bucket_bytes: int) -> None:
    """Global rank 0's parameters and buffers to every rank of ``group``, in flat buckets
    of at most ``bucket_bytes`` (one broadcast per bucket, not per tensor). Collective."""
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    for bucket in _buckets([t for t in tensors if t.numel() > 0], bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=0, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def wrap_ddp(model: torch.nn.Module, cfg: HDETConfig, topology: Topology, device: torch.device,
             ddp_kwargs: dict) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel`` on the group ``hdet.gradient_sharing`` names.

    "global": DDP over the world; its all-reduce averages the gradients of all W ranks
    (paper Sec. 3.1) and its start-up broadcast gives every replica rank 0's weights.
    "replica": DDP over the shard group (gradients stay in the replica between syncs);
    rank 0's weights are broadcast to the world first, since DDP broadcasts only inside
    its group and HDET's replicas must start as copies of one model; with S = 1 a comm
    hook skips the gradient all-reduce altogether. Collective.
    """
    from torch.nn.parallel import DistributedDataParallel

    replica_mode = cfg.gradient_sharing == "replica"
    if replica_mode and topology.replicas > 1:
        broadcast_module(model, topology.world_group, cfg.bucket_bytes)
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    group = topology.shard_group if replica_mode else topology.world_group
    ddp_model = DistributedDataParallel(model, process_group=group, **ddp_kwargs)
    if replica_mode and topology.shard_size == 1:
        ddp_model.register_comm_hook(None, _keep_local_gradients)
    return ddp_model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or ``model`` itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class FullParamsBackend:
    """Adapter for engines whose every rank holds the full parameters (DDP; fairscale's
    ``OSSBackend`` builds on it): the master tensors are the module's floating
    parameters themselves, so converge writes straight into what the next forward reads
    and ``refresh`` has nothing to do.

    Gradient sharing is the engine's own all-reduce (``shares_gradients``): DDP over the
    whole world averages the gradients of all W ranks, which is HDET's "global" mode.
    """

    shares_gradients = True

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device

    def master_tensors(self) -> Sequence[torch.Tensor]:
        return [p.data for p in self.module.parameters() if p.is_floating_point()]

    def install_grad_hook(self, hook: Any) -> None:
        raise NotImplementedError("the engine shares gradients itself (shares_gradients)")

    def noise_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank of the replica holds the whole model: nothing is sharded."""
        return [], list(self.master_tensors())

    def buffers(self) -> Sequence[torch.Tensor]:
        return persistent_float_buffers(self.module)

    def refresh(self) -> None:
        pass


# ---- checkpoint layout ----------------------------------------------------------------
