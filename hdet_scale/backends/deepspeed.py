"""DeepSpeed ZeRO-3 backend: the adapter, ``initialize`` and per-replica checkpoints.

ZeRO-3 partitions inside the shard group (the mpu of ``hdet_scale.topology``). This
adapter exposes the optimizer's flat fp32 master partitions and its flat gradient
partition buffer: converge and gradient sharing are then one (or a few) all-reduces,
whatever the number of parameter tensors.

DeepSpeed has no public API for the flat partitions (``safe_get_local_fp32_param`` is
per tensor and leaves the low-precision working copy alone), so this file reads
``fp32_partitioned_groups_flat``, ``fp16_partitioned_groups_flat`` and
``grad_partitions_flat_buffer`` of ``DeepSpeedZeroOptimizer_Stage3``; checked against
deepspeed 0.19 (see ``_check_zero3``), and the tests compare the result with
``GatheredParameters``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hdet_scale import iterates
from hdet_scale.averaging import persistent_float_buffers
from hdet_scale.backends.checkpoint_io import verify_checksums
from hdet_scale.backends.ds_machine import check_accelerator
from hdet_scale.backends.ds_prepare import prepare_config
from hdet_scale.backends.common import attach_sync, check_probe, check_sinks, use_topology, make_logger
from hdet_scale.backends.checkpoints import check_resumable, checkpoint_target, finish_checkpoint, load_hdet_state, replica_dir, save_hdet_state
from hdet_scale.backends.checkpoint_shapes import refuse_other_model
from hdet_scale.backends.optimizer_resume import group_settings, warn_kept_settings
from hdet_scale.backends.ds_adam import stateless_bias_correction
from hdet_scale.backends.ds_gather import gather_persistent
from hdet_scale.backends.ds_iterates import filled_client, step_groups_once
from hdet_scale.backends.ds_shared import link_tool_files, name_shared_params_everywhere
from hdet_scale.optimizers import build_client_optimizer, client_built
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups
from hdet_scale.errors import HDETConfigError
from hdet_scale.ds_values import check_client_optimizer
from hdet_scale.topology import Topology

_FLAT_ATTRS = ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "grad_partitions_flat_buffer",
               "_reassign_or_swap_out_partitioned_parameters", "_partition_all_parameters")


def _check_zero3(optimizer: Any) -> None:
    missing = [a for a in _FLAT_ATTRS if not hasattr(optimizer, a)]
    if missing:
        import deepspeed
        raise RuntimeError(f"hdet_scale needs DeepSpeed ZeRO-3 internals {missing}, absent in deepspeed "
                           f"{deepspeed.__version__} ({type(optimizer).__name__}); supported: deepspeed 0.19")


class DeepSpeedBackend:
    """Local tensors of one rank of a ZeRO-3 engine.

    ``master_tensors()``: the fp32 master partitions (1-D, float32, one per optimizer
    sub-group, this rank's ``1/S`` of the parameters). ``refresh()`` copies them into the
    low-precision working partitions (bf16 / fp16 / fp32) and re-gathers ZeRO-3's
    persistent (small, never partitioned) parameters, so the next forward pass reads
    the averaged weights (one all-gather for all persistent parameters: ``ds_gather``).
    """

    shares_gradients = False  # ZeRO reduces inside the shard group only: HDET's hook crosses replicas

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        _check_zero3(self.optimizer)
        self.device = torch.device(engine.device) if not isinstance(engine.device, torch.device) else engine.device
        self._count_skipped_steps()
        # DeepSpeed's CPU Adam keeps beta**t outside every checkpoint: without this a resumed
        # run's updates differ in the last bit from the uninterrupted run's (ds_adam.py).
        stateless_bias_correction(self.optimizer.optimizer)
        if iterates.spec_for(self.optimizer.optimizer) is not None:
            step_groups_once(self.optimizer)
        name_shared_params_everywhere(engine)  # zero_to_fp32.py on replica_1 keeps tied weights

    def _count_skipped_steps(self) -> None:
        """A step the engine skips still counts as an HDET step, on every rank.

        ZeRO-3 treats a non-finite gradient norm as an overflow for every dtype: it
        skips the update, and ``DeepSpeedEngine`` then skips ``lr_scheduler.step``. In
        "replica" gradient mode only the replica that saw it skips: its HDET step would
        fall behind and its next sync would pair with the others' later collectives (a
        hang). The rule is torch AMP's (the scheduler steps while GradScaler skips
        ``optimizer.step``): after ``engine.step`` at an accumulation boundary whose
        update was not applied (public ``was_step_applied()``), make the scheduler call
        the engine skipped, with the same ``lr_kwargs``. The engine calls it only when
        the update was applied: never twice a step.
        """
        engine = self.engine
        original = engine.step

        def step(lr_kwargs: dict | None = None) -> Any:
            boundary = engine.is_gradient_accumulation_boundary()  # before step() advances the count
            scheduler = engine.lr_scheduler
            if boundary and isinstance(scheduler, HDETScheduler):
                # A bad loss is refused before the update is applied, not after it by the
                # scheduler inside DeepSpeed (whose TypeError fallback would record
                # train_batch_size as the loss): no state changes, on every rank alike.
                scheduler.check_step_args(**(lr_kwargs or {}))
                scheduler.check_can_step()  # past total_steps: before the optimizer moves a weight
            out = original(lr_kwargs=lr_kwargs)
            if boundary and not engine.was_step_applied() and isinstance(scheduler, HDETScheduler):
                # The loss passed is recorded as on any step, not replaced by NaN: fp16 loss
                # scaling skips steps routinely (a loss-scale overflow says nothing about
                # the replica's hyperparameters, and NaN would exclude the replica from
                # every interval holding one). A forward that was itself non-finite passes
                # a NaN loss, and the rules for a non-finite interval loss then apply
                # (softmax weight 0, left out of converge).
                scheduler.step(**(lr_kwargs or {}))
            return out

        engine.step = step

    def master_tensors(self) -> Sequence[torch.Tensor]:
        return list(self.optimizer.fp32_partitioned_groups_flat)

    def local_optimizer(self) -> Any:
        """A context manager yielding the client optimizer with its groups holding this
        rank's fp32 master partitions (:func:`ds_iterates.filled_client`)."""
        return filled_client(self.optimizer)

    def buffers(self) -> Sequence[torch.Tensor]:
        return persistent_float_buffers(self.engine.module)

    def frozen_tensors(self) -> Sequence[torch.Tensor]:
        """This rank's tensors of the parameters the optimizer does not hold
        (``requires_grad`` false: a frozen embedding, a LoRA base): each one's ZeRO-3
        partition (``ds_tensor``, working dtype) and, where it is gathered between steps
        (persistent), its full tensor. Nothing changes them, so converge leaves them
        alone, but the start copy must cover them: without it, replica 1 keeps its own
        frozen weights (under HDETTrainer its embedding may hold uninitialised memory,
        sum of |x| 3e28)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        out = []
        for p in self.engine.module.parameters():
            if p.requires_grad or not hasattr(p, "ds_tensor"):
                continue
            out.append(p.ds_tensor)
            if p.ds_status == ZeroParamStatus.AVAILABLE:
                out.append(p.data)
        return out

    def noise_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fp32 master partitions are this rank's shard; nothing is whole."""
        return list(self.master_tensors()), []

    @torch.no_grad()
    def refresh(self) -> None:
        opt = self.optimizer
        # As DeepSpeed's own step does: release every gathered parameter first. Persistent
        # parameters stay gathered (AVAILABLE) between steps, and all_gather skips
        # AVAILABLE ones, so without this their working copy keeps the pre-converge values.
        opt._partition_all_parameters()
        for i in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        # One all-gather for all of them (ds_gather.py), not DeepSpeed's one per parameter.
        gather_persistent(list(opt.persistent_parameters))
        if hasattr(opt, "invalidate_secondary_tensor"):
            opt.invalidate_secondary_tensor()

    def install_grad_hook(self, hook: Callable[[list[torch.Tensor]], None]) -> None:
        """Run ``hook([flat gradient partition])`` at every accumulation boundary, after
        ZeRO's reduce-scatter and before the optimizer's overflow check, clipping and
        step (so clipping sees the shared gradient's norm)."""
        opt = self.optimizer
        original = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            hook([opt.grad_partitions_flat_buffer])
            return original(*args, **kwargs)

        opt.step = step

    def install_overlapped_sharing(self, group: Any, replicas: int) -> Any:
        """Gradient sharing overlapped with the backward pass (``ds_overlap.py``); the
        installed :class:`OverlappedGradientSharing`, or ``None`` where this optimizer
        cannot (then the caller installs the hook)."""
        from hdet_scale.backends.ds_overlap import OverlappedGradientSharing

        if OverlappedGradientSharing.supported(self.optimizer) is not None:
            return None
        sharing = OverlappedGradientSharing(self.optimizer, group, replicas)
        sharing.install()
        return sharing

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups


#: Variables an MPI launcher sets in each rank (Open MPI, MPICH / Intel MPI, PMIx, MVAPICH).
_MPI_MARKS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def mpi_discovery_wanted() -> bool:
    """Whether ``deepspeed.init_distributed`` may look for an MPI world: only when the
    ``env://`` variables torch needs (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) are incomplete, or an MPI launcher started this process. DeepSpeed also
    asks for ``LOCAL_RANK`` and, without it, imports ``mpi4py`` (a RANK left in a shell
    without LOCAL_RANK would end in a ModuleNotFoundError traceback on DeepSpeed while
    FSDP2 joins the world as the note says). torch's ``env://`` does not need
    ``LOCAL_RANK``, which ``_init_distributed`` then sets to 0 on CPU (DeepSpeed reads it
    for its device) and asks for on an accelerator."""
    env_world = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    return not env_world or any(k in os.environ for k in _MPI_MARKS)


def _init_distributed(dist_backend: str | None) -> str:
    """``deepspeed.init_distributed`` (gloo on CPU) unless done; bind this process to
    ``$LOCAL_RANK``'s accelerator (the DeviceMesh is built before DeepSpeed's engine picks
    the device). Returns the accelerator's device name.

    Raises:
        HDETConfigError: ``LOCAL_RANK`` unset on an accelerator while the ``env://``
            world is given (:func:`mpi_discovery_wanted`), before any collective.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from hdet_scale.backends.ds_cpuinfo import remember

    remember()  # before any op loads: py-cpuinfo's 2 x 1.1 s per rank (ds_cpuinfo)
    accel = get_accelerator()
    if "LOCAL_RANK" not in os.environ and not mpi_discovery_wanted():
        # DeepSpeed reads os.environ["LOCAL_RANK"] for its device (zero.Init, the engine):
        # a KeyError for ranks started by hand. On CPU every index names
        # the one device; on an accelerator a guess could put two ranks on one device.
        if accel.device_name() != "cpu":
            raise HDETConfigError("LOCAL_RANK is not set, and DeepSpeed needs it (this rank's device index on its "
                                  "node): start the ranks with torchrun or the deepspeed launcher, or set LOCAL_RANK")
        os.environ["LOCAL_RANK"] = "0"
    if not dist.is_initialized():
        from hdet_scale.backends.rendezvous import joining

        with joining():  # a peer that never joins: said every minute; Ctrl-C / SIGTERM end the wait
            deepspeed.init_distributed(dist_backend=dist_backend or ("gloo" if accel.device_name() == "cpu" else None),
                                       auto_mpi_discovery=mpi_discovery_wanted())
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return accel.device_name()


def build_topology(config: str | dict, dist_backend: str | None = None) -> Topology:
    """The process groups of the ``R x S`` layout from a DeepSpeed config's ``"hdet"``
    block, built before the model so that it can be constructed partitioned
    (:func:`zero_init`) and handed to :func:`initialize` ``(..., topology=...)``.

    The config is validated first (:func:`prepare_config`, no communication, the same
    verdict on every rank); then ``torch.distributed`` is initialised if needed
    (``deepspeed.init_distributed``; gloo on CPU) and the DeviceMesh built. Collective.

    Raises:
        HDETConfigError: an invalid config, or ``hdet`` disabled (plain DeepSpeed needs
            no layout of ours).
    """
    cfg, _ = prepare_config(config)
    if not cfg.enabled:
        raise HDETConfigError("hdet.enabled: false; build_topology is for HDET runs (plain DeepSpeed: use "
                              "deepspeed.zero.Init and deepspeed.initialize)")
    return Topology(cfg.replicas, device_type=_init_distributed(dist_backend))


def zero_init(topology: Topology, config: str | dict, **kwargs: Any) -> Any:
    """``deepspeed.zero.Init`` partitioned over ``topology``'s shard group: build the model
    inside it and no rank holds more than one module's full parameters at a time; each
    rank keeps its ``1/S`` partition of every parameter (``p.ds_tensor``), which
    :func:`initialize` with the same ``topology`` then trains::

        topology = hdet_scale.build_topology("ds_config.json")
        with hdet_scale.zero_init(topology, "ds_config.json"):
            model = MyModel(...)          # constructors run; parameters are partitioned
        engine, opt, _, scheduler = hdet_scale.initialize(model, config="ds_config.json",
                                                          topology=topology, ...)

    Parameters are partitioned as each module's ``__init__`` returns, so initialisation
    code that runs later (e.g. a ``post_init`` re-drawing weights) sees empty tensors:
    initialise in the constructors, write the partitions (``p.ds_tensor``) yourself, or
    use ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``. With the same seed,
    weights drawn in the constructors equal an unpartitioned build's.

    Import the model's classes before the context opens (``from transformers import
    LlamaForCausalLM`` at the top of the script, not inside): DeepSpeed wraps the
    ``__init__`` of each class defined while it is open and, on exit, puts back the one it
    wrapped, undoing any class decorator applied after it. transformers >= 5.25 decorates
    its attention classes (``use_kernelized_func``, from ``kernels``) and imports them
    lazily: a model of that class built after the context then fails in its forward
    (``'LlamaAttention' object has no attribute '_kernel_funcs'``); the one built inside
    is unaffected. ``hdet-train`` imports its model class before (``check_buildable``).

    ``kwargs`` go to ``deepspeed.zero.Init`` (e.g. ``remote_device="cpu"``); the config
    (without its ``hdet`` block, batch keys per replica) sets the dtype.

    Raises:
        HDETConfigError: an invalid config, or ``topology`` built for another number
            of replicas than its ``hdet.replicas``.
    """
    import deepspeed
    # zero.Init replaces torch's tensor constructors while it is open; torch._dynamo's
    # first import (which transformers triggers lazily) checks their signatures and fails
    # under the replacement. Import it before the context opens.
    import torch._dynamo  # noqa: F401

    cfg, ds = prepare_config(config, world_size=topology.world_size)
    use_topology(cfg, topology, topology.mesh.device_type)  # same layout as the config, or a clear error
    return deepspeed.zero.Init(data_parallel_group=topology.shard_group, mpu=topology.mpu(),
                               config_dict_or_path=ds, **kwargs)


#: ``deepspeed.initialize`` arguments HDET gives itself when the block is on.
_HDET_KWARGS = {
    "lr_scheduler": "the HDET scheduler is the engine's lr_scheduler (hdet.schedule sets the LR: docs/config.md)",
    "mpu": "HDET's topology hands DeepSpeed the shard group (pass topology=hdet_scale.build_topology(config) to "
           "build the process groups first)",
    "mesh_param": "HDET's topology hands DeepSpeed the shard group (topology=hdet_scale.build_topology(config))",
    "config_params": "give the DeepSpeed config (with its hdet block) as config=",
}


def initialize(model: torch.nn.Module, config: str | dict, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, collate_fn: Any = None, logger: Any = None,
               dist_backend: str | None = None, probe: Any = None, topology: Topology | None = None,
               **kwargs: Any):
    """``deepspeed.initialize`` with HDET set up from the config's ``"hdet"`` block.

    ``logger``: a :class:`~hdet_scale.logging.MetricsLogger`; by default one is built
    from ``hdet.logging`` (global rank 0 writes).

    ``probe``: ``probe(engine) -> loss`` (0-dim tensor or float, nats), this rank's loss
    on its slice of fixed probe batches (shard rank s of every replica evaluates the same
    slice s; :attr:`Topology.shard_index` of ``scheduler.topology``). It runs under
    ``torch.no_grad`` at each auto-LR sync, inside ``engine.step`` after the optimizer
    step and before converge; the replica's fitness is the mean over its S ranks. Needed
    when ``hdet.auto.fitness`` is ``"probe"`` (the default) and auto-LR is on. Every
    replica starts from replica 0's weights (its fp32 master partitions and buffers,
    broadcast over the replica groups; DeepSpeed itself broadcasts only inside the shard
    group), whatever each rank's seed was. With ``hdet.warm_init.enabled``, each
    replica's noise is added after that, before this returns.

    Returns ``(engine, optimizer, dataloader, scheduler)`` like DeepSpeed; the scheduler is
    an :class:`~hdet_scale.ensemble.HDETScheduler` (also ``engine.lr_scheduler``), driven
    by ``engine.step(lr_kwargs={"loss": loss})``. The dataloader (when ``training_data``
    is given) shards the data over all W ranks, not over the shard group DeepSpeed sees.

    ``topology``: the process groups from :func:`build_topology` (same config), needed
    when ``model`` was built under :func:`zero_init` (its partitions live on that shard
    group); default: built here.

    Validation happens before ``torch.distributed`` is touched, identically on every rank.

    Raises:
        HDETConfigError: invalid ``"hdet"`` block, incompatible DeepSpeed keys, a
            ``topology`` of another layout, or (with the block on) a keyword HDET gives
            ``deepspeed.initialize`` itself: ``lr_scheduler``, ``mpu``, ``mesh_param``,
            ``config_params``.
    """
    import deepspeed

    cfg, ds = prepare_config(config)
    taken = sorted(k for k in kwargs if k in _HDET_KWARGS) if cfg.enabled else []
    if taken:  # not deepspeed.initialize's TypeError "got multiple values for keyword argument"
        raise HDETConfigError("hdet_scale.initialize: " + "; ".join(f"{k}= is HDET's to give DeepSpeed: "
                                                                    f"{_HDET_KWARGS[k]}" for k in taken))
    if logger is None:  # the block's sinks are used (make_logger below), not a caller's logger (hdet-train's)
        check_sinks(cfg)
    check_probe(cfg, probe)
    check_accelerator(ds)
    check_client_optimizer(ds, optimizer, cfg.enabled)  # no optimizer at all; one ZeRO calls untested
    if not cfg.enabled:
        engine, opt, loader, sched = deepspeed.initialize(model=model, optimizer=optimizer, config=ds,
                                                          model_parameters=model_parameters,
                                                          training_data=training_data, collate_fn=collate_fn,
                                                          **kwargs)
        return engine, opt, loader, sched
    name = client_built(ds) if optimizer is None else None
    if name is not None:  # an optimizer DeepSpeed does not know (schedule-free AdamW): built here
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer, ds = build_client_optimizer(name, params, ds)
        model_parameters = None
    topology = use_topology(cfg, topology, _init_distributed(dist_backend))
    if logger is None:
        logger = make_logger(cfg, topology, {"hdet": cfg.to_dict(), "deepspeed": ds})
    holder: dict[str, HDETScheduler] = {}

    def make_scheduler(opt: torch.optim.Optimizer) -> HDETScheduler:
        holder["s"] = HDETScheduler(cfg, LiveParamGroups({topology.replica_index: opt}), logger=logger)
        return holder["s"]

    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                                             config=ds, mpu=topology.mpu(), lr_scheduler=make_scheduler, **kwargs)
    scheduler = holder["s"]
    attach_sync(scheduler, topology, DeepSpeedBackend(engine), engine, probe)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=topology.world_size,
                                                      rank=topology.rank, shuffle=True, seed=cfg.seed)
        loader = torch.utils.data.DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                             sampler=sampler, collate_fn=collate_fn, drop_last=True)
    return engine, opt, loader, scheduler


# ---- checkpoints ----------------------------------------------------------------------
# Layout: <dir>/latest, <dir>/hdet_layout.json, <dir>/replica_<r>/<tag>/... (DeepSpeed's
# files of replica r) and <dir>/replica_<r>/<tag>/hdet_shard_<s>.pt (the HDET state of
# rank (r, s)). DeepSpeed names its files by shard rank only, so each replica gets its
# own folder: no two ranks write one file, and every replica's (diverged) weights and
# optimizer state survive.

def save_checkpoint(engine: Any, scheduler: HDETScheduler, save_dir: str, tag: str | None = None,
                    client_state: dict | None = None) -> str:
    """Save every replica's DeepSpeed state and every rank's HDET state. Collective: all
    ranks call it at the same step. Returns the tag."""
    # DeepSpeed creates save_dir on global rank 0 only: every replica makes its own folder.
    t, tag, rdir = checkpoint_target(scheduler, save_dir, tag)
    engine.save_checkpoint(os.path.dirname(rdir), tag=tag, client_state=client_state or {}, save_latest=False)
    save_hdet_state(rdir, t, scheduler)
    finish_checkpoint(save_dir, t, scheduler, tag, "deepspeed")
    if t.rank == 0:
        link_tool_files(save_dir, t.replicas)
    return tag


def load_checkpoint(engine: Any, scheduler: HDETScheduler, load_dir: str, tag: str | None = None) -> dict:
    """Restore what :func:`save_checkpoint` wrote. Returns what DeepSpeed's
    ``engine.load_checkpoint`` returns as client state: the ``client_state`` given to
    :func:`save_checkpoint` plus entries DeepSpeed stores itself (e.g. ``buffer_names``).

    Raises:
        HDETStateError: no checkpoint, another ``R x S`` layout or backend, or a missing
            replica folder (checked before any collective, identically on every rank).
            Then a file of the replica's folder whose bytes changed since it was written
            (its CRC-32s, ``checkpoint_io.verify_checksums``: one collective on the world
            group, every rank raising alike, before anything is loaded). Then a checkpoint of another model (tensors of
            another shape, missing or extra: ``checkpoint_shapes.refuse_other_model``,
            one more collective, every rank raising alike, before anything is loaded).
    """
    t = scheduler.topology
    tag = check_resumable(load_dir, t.world_size, t.replicas, "deepspeed", tag)
    verify_checksums(load_dir, tag, t)
    rdir = replica_dir(load_dir, t, tag)
    # ZeRO-3 partitions: ds_shape is the full shape
    refuse_other_model("deepspeed", load_dir, tag, rdir,
                       {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}, t)
    settings = group_settings(engine.optimizer)
    _, client = engine.load_checkpoint(os.path.dirname(rdir), tag=tag, load_lr_scheduler_states=False)
    warn_kept_settings(settings, engine.optimizer, scheduler.config.axes)
    load_hdet_state(rdir, t, scheduler)
    return client or {}
