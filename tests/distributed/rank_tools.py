"""Helpers shared by the distributed tests (test_deepspeed, test_fsdp2, test_fairscale,
test_ddp, test_agreement) and their rank workers (``*_workers``).

conftest.py puts tests/distributed on ``sys.path`` and spawned rank processes inherit it,
so a plain ``import rank_tools`` works in the test process and in every rank.

- Rank side: seeded models and batches that leave the global RNG alone, tensor -> numpy
  conversion, a wrapper that captures what converge is about to average, guards that
  forbid or record ``torch.distributed`` collectives, a recorder of checkpoint writes.
- Test side: launching the ranks, pinning torch to one thread, cross-rank and checkpoint
  assertions.

The 2 x 2 layout of the sharded tests: ``WORLD`` = 4 ranks = ``REPLICAS`` = 2 replica
groups x ``S`` = 2 shards; ranks 0, 1 = replica 0, ranks 2, 3 = replica 1.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from harness import run_ranks

REPLICAS, S, WORLD = 2, 2, 4
# Sizes, micro-batch and LR of the buffered MLP (TinyNet) the DeepSpeed and fairscale workers share.
D_IN, D_HIDDEN, D_OUT, MICRO = 8, 16, 4, 2
LR = 1e-2
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # every rank process
DS_ENV = {"DS_ACCELERATOR": "cpu", **ENV}  # rank processes that run DeepSpeed on CPU

# Every torch.distributed collective name a guard below patches (where this torch has
# it); FSDP2 on torch 2.13 calls all_gather_single and reduce_scatter_single.
COLLECTIVES = ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_object",
               "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
               "all_to_all", "all_to_all_single", "monitored_barrier", "new_group", "send", "recv", "isend", "irecv")


# ---- rank side: model, data, config -----------------------------------------------------

def default_draw(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """New value of parameter ``name``: ``norm.weight`` (the LayerNorm gain) 1 + 0.1 N(0, 1),
    matrices N(0, 1) / sqrt(fan_in), other vectors 0.1 N(0, 1)."""
    if name == "norm.weight":
        return 1.0 + 0.1 * torch.randn(p.shape, generator=g)
    if p.dim() == 2:
        return torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
    return 0.1 * torch.randn(p.shape, generator=g)


def seeded_model(make: Callable[[], torch.nn.Module], seed: int = 0,
                 draw: Callable[[str, torch.Tensor, torch.Generator], torch.Tensor] = default_draw
                 ) -> torch.nn.Module:
    """``make()`` with the global RNG restored afterwards (its default init draws from it),
    then every parameter, in ``named_parameters`` order, set to ``draw(name, p, g)`` from a
    ``torch.Generator`` seeded with ``seed``: the same weights on every rank and in the test
    process for a given seed, without touching the global RNG."""
    with torch.random.fork_rng():
        model = make()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(draw(name, p, g))
    return model


def seeded_batch(seed: int, micro: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``micro`` rows of ``d_in`` inputs and of ``d_out`` targets, N(0, 1), from a
    generator seeded with ``seed`` (each rank and step gets its own seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(micro, d_in, generator=g), torch.randn(micro, d_out, generator=g)


def probe_input(d_in: int = D_IN) -> torch.Tensor:
    """The fixed 3-row probe input (seed 999) whose forward output the tests compare."""
    return torch.randn(3, d_in, generator=torch.Generator().manual_seed(999))


# The buffered MLP, data and probe input of the DeepSpeed and fairscale workers.


class TinyNet(torch.nn.Module):
    """3 Linear layers and a LayerNorm (small tensors: ZeRO-3 persistent parameters under
    the default threshold; for OSS, 8 tensors of unequal sizes, so its greedy partition
    gives each shard rank several), plus a persistent float buffer: a running mean of the inputs
    seen in training (like BatchNorm statistics; DeepSpeed never syncs it, so it differs
    between ranks and converge must average it). The buffer does not enter the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_HIDDEN)
        self.norm = torch.nn.LayerNorm(D_HIDDEN)
        self.fc2 = torch.nn.Linear(D_HIDDEN, D_HIDDEN)
        self.head = torch.nn.Linear(D_HIDDEN, D_OUT)
        self.register_buffer("input_mean", torch.zeros(D_IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.input_mean.mul_(0.9).add_(x.mean(0).to(self.input_mean.dtype), alpha=0.1)
        h = F.gelu(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        return self.head(h)


def build_model(seed: int = 0) -> TinyNet:
    """Same weights on every rank for a given seed, without touching the global RNG."""
    return seeded_model(TinyNet, seed)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for optimizer step ``step`` (1-based), from its own generator."""
    return seeded_batch(10_000 + 1_000 * rank + step, MICRO, D_IN, D_OUT)


# Fixed probe batches (auto.fitness "probe"): PROBE_ROWS rows in all, split into S equal
# slices; shard rank s of every replica evaluates slice s, so every replica is scored on
# the same rows and the mean over a replica's S ranks is the loss on all of them.
PROBE_ROWS, PROBE_SEED = 8, 30_000


def probe_slice(shard: int, shards: int, d_in: int = D_IN, d_out: int = D_OUT, rows: int = PROBE_ROWS,
                seed: int = PROBE_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``shard`` of ``shards`` equal slices of the fixed probe set ``(x, y)`` (``rows``
    rows from a generator seeded with ``seed``; ``shards`` = 1: all of it)."""
    assert rows % shards == 0, "equal slices: the mean of the slice means is the mean over all rows"
    x, y = seeded_batch(seed, rows, d_in, d_out)
    n = rows // shards
    return x[shard * n:(shard + 1) * n], y[shard * n:(shard + 1) * n]


def probe_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE of ``model`` on ``(x, y)`` in eval mode (training-time buffer updates off; the
    mode is restored), without grad: the loss a probe returns."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return F.mse_loss(model(x.to(_param_dtype(model))).float(), y)
    finally:
        model.train(was)


def _param_dtype(model: Any) -> torch.dtype:
    p = next(iter(model.parameters()), None)
    return p.dtype if p is not None and p.is_floating_point() else torch.float32


def make_probe(shard: int, shards: int = S, calls: list | None = None, **slice_kw: Any) -> Callable[[Any], Any]:
    """``probe(model) -> loss`` for ``initialize(..., probe=...)``: this rank's loss on slice
    ``shard`` of the probe set; with ``calls``, each call appends ``{"shard", "loss",
    "x_sum"}`` (the slice index, the loss as float, the sum of its inputs)."""
    x, y = probe_slice(shard, shards, **slice_kw)

    def probe(model: Any) -> torch.Tensor:
        loss = probe_loss(model, x, y)
        if calls is not None:
            calls.append({"shard": shard, "loss": float(loss), "x_sum": float(x.double().sum())})
        return loss

    return probe


def rank_probe(calls: list | None = None, **slice_kw: Any) -> Callable[[Any], Any]:
    """``make_probe`` for this rank of the 2 x 2 layout (shard index ``rank() % S``)."""
    return make_probe(rank() % S, S, calls, **slice_kw)


def hdet_block(**overrides: Any) -> dict:
    """The per-backend tests' HDET block: ``REPLICAS`` replicas, sync every 3 steps, global
    gradients, LR spread 0.5, constant schedule over 100 steps; ``overrides`` replace
    top-level keys."""
    block: dict[str, Any] = {"replicas": REPLICAS, "sync_interval": 3, "gradient_sharing": "global",
                             "axes": {"lr": {"spread_ratio": 0.5}},
                             "schedule": {"name": "constant", "total_steps": 100}}
    block.update(overrides)
    return block


def rank() -> int:
    """This process's global rank, from the ``RANK`` variable the harness sets."""
    return int(os.environ["RANK"])


def init_dist() -> None:
    """Start the gloo process group from the environment unless one is up already."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")


# ---- rank side: reading a rank ----------------------------------------------------------

def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A detached float32 copy of ``t``, flattened, as a numpy array."""
    return t.detach().float().reshape(-1).clone().cpu().numpy()


def flat_numpy(tensors: Iterable[torch.Tensor]) -> np.ndarray:
    """``to_numpy`` of each tensor, concatenated (e.g. a model's parameters, module order)."""
    return np.concatenate([to_numpy(t) for t in tensors])


def buffer_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """``{name: to_numpy(buffer)}`` for every buffer of ``module``."""
    return {n: to_numpy(b) for n, b in module.named_buffers()}


def eval_output(module: Any, x: torch.Tensor) -> np.ndarray:
    """``module(x)`` in eval mode (no training-time buffer update) and without grad, as
    ``to_numpy``; the module is put back in train mode."""
    module.eval()
    with torch.no_grad():
        out = module(x)
    module.train()
    return to_numpy(out)


def lrs(opt: Any) -> list[float]:
    """The LR of every param group of ``opt``: what its next step uses."""
    return [float(g["lr"]) for g in opt.param_groups]


def clean_record(record: dict) -> dict:
    """A sync record without its timing (``hdet/converge_s`` differs per rank)."""
    return {k: v for k, v in record.items() if k != "hdet/converge_s"}


def sched_state(sched: Any) -> dict:
    """The HDET scheduler's step, permutations, controller state (base values of the
    "paper" controller, log multipliers of the "log" one, velocities, update count) and
    last sync record (without timing), as plain data with string keys."""
    ctl = sched.controller
    return {"step": sched.step_count, "permutations": {str(k): list(v) for k, v in sched.permutations.items()},
            "base": {str(k): v for k, v in ctl.base.items()},
            "log_m": {str(k): v for k, v in ctl.log_m.items()},
            "velocity": {str(k): v for k, v in ctl.velocity.items()},
            "updates": ctl.updates,
            "last_sync": clean_record(sched.last_sync)}


def capture_converge(sched: Any, store: list, snapshot: Callable[[], dict],
                     during: Callable[[dict], Any] | None = None) -> None:
    """Wrap the sync object's converge: append ``{"step", "finite", **snapshot()}`` to
    ``store`` (what converge is about to average, after the sync step's own optimizer
    update), then converge, inside the context manager ``during(record)`` if given.
    ``del sched.sync_obj.converge`` unwraps."""
    sync = sched.sync_obj
    original = sync.converge

    def converge(finite: list[bool]) -> None:
        record = {"step": sched.step_count, "finite": list(finite), **snapshot()}
        store.append(record)
        with during(record) if during is not None else contextlib.nullcontext():
            return original(finite)

    sync.converge = converge


# ---- rank side: guards --------------------------------------------------------------------

@contextlib.contextmanager
def patched_collectives(wrap: Callable[[Any, str, Callable], Callable], *, device_mesh: bool = False):
    """Inside the block, every ``torch.distributed`` function named in ``COLLECTIVES`` (those
    this torch has) is replaced by ``wrap(module, name, original)``; with ``device_mesh``,
    ``torch.distributed.device_mesh.init_device_mesh`` too (its ``new_group`` calls bypass
    the ``torch.distributed`` attributes). Only calls made through the module attributes
    are seen."""
    import torch.distributed as dist
    saved = {(dist, n): getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    if device_mesh:
        import torch.distributed.device_mesh as dm
        saved[(dm, "init_device_mesh")] = dm.init_device_mesh
    for (mod, n), f in saved.items():
        setattr(mod, n, wrap(mod, n, f))
    try:
        yield
    finally:
        for (mod, n), f in saved.items():
            setattr(mod, n, f)


def no_collectives(*, device_mesh: bool = False, allow: tuple[str, ...] = ()):
    """Context manager: any ``torch.distributed`` collective (and, with ``device_mesh``,
    DeviceMesh creation) raises AssertionError inside the block, except those named in
    ``allow``."""
    def forbidden(mod: Any, name: str, original: Callable) -> Callable:
        if name in allow:
            return original

        def f(*args, **kwargs):
            raise AssertionError(f"collective {mod.__name__}.{name} called")
        return f

    return patched_collectives(forbidden, device_mesh=device_mesh)


def error_text(fn: Callable[[], Any], catch: type | tuple = Exception, *, device_mesh: bool = False) -> str | None:
    """Run ``fn()`` with collectives forbidden (``no_collectives``): None if it returns,
    else ``"ClassName: message"`` of the error it raised, which must be a ``catch``
    (others propagate). A forbidden collective shows as ``AssertionError``."""
    try:
        with no_collectives(device_mesh=device_mesh):
            fn()
    except catch as e:
        return f"{type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def record_writes(root: str, written: list, copy_module: Any = None):
    """Append to ``written`` the path, relative to ``root``, of every file this rank writes
    through ``torch.save`` to a path and, given ``copy_module``, through its ``copyfile``
    (DeepSpeed's engine copies its recovery scripts with it)."""
    save = torch.save
    copy = copy_module.copyfile if copy_module is not None else None

    def rec_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            written.append(os.path.relpath(os.fspath(f), root))
        return save(obj, f, *args, **kwargs)

    def rec_copy(src, dst, *args, **kwargs):
        written.append(os.path.relpath(os.fspath(dst), root))
        return copy(src, dst, *args, **kwargs)

    torch.save = rec_save
    if copy_module is not None:
        copy_module.copyfile = rec_copy
    try:
        yield
    finally:
        torch.save = save
        if copy_module is not None:
            copy_module.copyfile = copy


def files_under(root: str | os.PathLike) -> set[str]:
    """Paths, relative to ``root``, of every file below it."""
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


# ---- test side ------------------------------------------------------------------------------

def launch(fn: Callable, *args: Any, timeout: float, world: int = WORLD, env: dict = ENV,
           allow_errors: bool = False) -> list:
    """``fn(*args)`` on ``world`` spawned ranks with ``env`` (``harness.run_ranks``, which
    kills every rank after ``timeout`` s and names the stuck ones); each rank's result."""
    return run_ranks(fn, world, args=args, timeout=timeout, env=env, allow_errors=allow_errors)


@contextlib.contextmanager
def one_thread():
    """torch computes with one thread inside the block, as the ranks do."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def replica_of(rank: int) -> int:
    """The replica (model copy) of global rank ``rank`` in the 2 x 2 layout."""
    return rank // S


def assert_all_equal(arrays: list, what: str) -> None:
    """Every rank's array is bit-identical to rank 0's."""
    for r, a in enumerate(arrays[1:], start=1):
        np.testing.assert_array_equal(a, arrays[0], err_msg=f"{what}: rank {r} != rank 0")


def reference_forward(model: torch.nn.Module, flat: np.ndarray, x: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> np.ndarray:
    """``model``'s output on ``x`` (flat float32 numpy) in eval mode, in this process, with
    its parameters set from ``flat`` (module order; the sizes must add up) and cast, like
    ``x``, to ``dtype``."""
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(torch.from_numpy(flat[offset:offset + p.numel()].copy()).view_as(p))
            offset += p.numel()
        assert offset == flat.size
        model.eval()
        for p in model.parameters():
            p.data = p.data.to(dtype)
        return model(x.to(dtype)).float().numpy().reshape(-1)


def assert_single_writers(ckpt: str | os.PathLike, per_rank: list[list[str]]) -> list[collections.Counter]:
    """No checkpoint file was written twice (by one rank or two), and the files below
    ``ckpt`` are exactly those written plus rank 0's ``hdet_layout.json`` and ``latest``.
    Returns each rank's Counter of the paths it wrote."""
    written = [collections.Counter(w) for w in per_rank]
    everyone = sum(written, collections.Counter())
    assert not [f for f, n in everyone.items() if n > 1], f"files written twice: {everyone}"
    # and each checkpoint folder's manifest (backends/manifest.py), one per folder written
    manifests = {f for f in files_under(ckpt) if os.path.basename(f) == "hdet_manifest.json"}
    # the DeepSpeed backend's replica_<r>/latest: a link to ../latest for DeepSpeed's tools,
    # and replica_<r>/zero_to_{fp32,torch}.py (r > 0): links to replica 0's copies of its scripts
    links = {f for f in files_under(ckpt) if os.path.islink(os.path.join(ckpt, f))}
    allowed = {os.path.join("..", "latest"), *(os.path.join("..", "replica_0", f"zero_to_{s}.py") for s in ("fp32", "torch"))}
    assert all(os.readlink(os.path.join(ckpt, f)) in allowed for f in links), links
    assert files_under(ckpt) - manifests - links == set(everyone) | {"hdet_layout.json", "latest"}
    folders = {os.path.dirname(f) for f in everyone if f.count(os.sep) == 2}  # replica_<r>/<tag>/<file>
    assert {os.path.dirname(f) for f in manifests} == folders, (manifests, folders)
    return written


def assert_layout_refused(errors: list) -> None:
    """Each rank's error text from loading a 2 x 2 checkpoint into a 4 x 1 layout: an
    HDETStateError that names both layouts."""
    for err in errors:
        assert err is not None and err.startswith("HDETStateError"), err
        assert "2 replicas x 2 shards" in err and "4 x 1" in err, err
