"""The (replica, shard) layout of the world, its process groups and the DeepSpeed mpu.

``W = R x S`` ranks; global rank ``g = r * S + s`` (shard groups are runs of consecutive
ranks, so a replica's shards sit on one node when S divides the node size)::

    shard group   r: ranks r*S .. r*S + S-1     (ZeRO-3 / FSDP shard inside it)
    replica group s: ranks s, S + s, ..., (R-1)*S + s   (converge all-reduces over it)

The layout arithmetic is pure (``Layout``) so a config can be checked for a world we do
not have (``hdet-dryrun``); ``Topology`` adds the process groups from a DeviceMesh.
"""

from __future__ import annotations

import atexit
import math
import os
import time
from dataclasses import dataclass

from hdet_scale.errors import HDETConfigError

#: What :meth:`Layout.describe`'s header adds: which group is which.
LEGEND = (" (shard group r: the ranks of replica r; replica group s: the ranks holding shard s in every replica, "
          "which converge averages over)")


def _divisors(n: int) -> list[int] | str:
    """The divisors of ``n`` in order, by trial up to sqrt(n) (hdet-dryrun takes any
    world size); for a world above 10**14 (10**7 trials) the rule instead of the list."""
    if n > 10**14:
        return f"the divisors of {n}"
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class Layout:
    """Pure ``R x S`` arithmetic for one rank. Raises HDETConfigError when ``replicas``
    does not divide ``world_size``."""

    world_size: int
    replicas: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.world_size % self.replicas != 0:
            raise HDETConfigError(
                f"hdet.replicas: {self.replicas} replicas do not divide the world of {self.world_size} ranks; "
                f"allowed values for this world: {_divisors(self.world_size)}"
                # `python train.py` runs a world of one process
                + (" (a world of 1: a script started with plain `python` instead of `torchrun --nproc-per-node N` "
                   "or the `deepspeed` launcher?)" if self.world_size == 1 else ""))
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    @property
    def shard_size(self) -> int:
        """S, ranks per replica (the ZeRO-3 / FSDP data-parallel group)."""
        return self.world_size // self.replicas

    @property
    def replica_index(self) -> int:
        return self.rank // self.shard_size

    @property
    def shard_index(self) -> int:
        return self.rank % self.shard_size

    def shard_group_ranks(self, replica_index: int | None = None) -> list[int]:
        r = self.replica_index if replica_index is None else replica_index
        return [r * self.shard_size + s for s in range(self.shard_size)]

    def replica_group_ranks(self, shard_index: int | None = None) -> list[int]:
        s = self.shard_index if shard_index is None else shard_index
        return [r * self.shard_size + s for r in range(self.replicas)]

    def describe(self) -> str:
        # "replica group 0: ranks [0]" would read as "replica 0"; the legend says which is which
        lines = [f"world {self.world_size} = {self.replicas} replicas x {self.shard_size} shards{LEGEND}"]
        for r in range(self.replicas):
            lines.append(f"  shard group   {r}: ranks {self.shard_group_ranks(r)}")
        for s in range(self.shard_size):
            lines.append(f"  replica group {s}: ranks {self.replica_group_ranks(s)}")
        return "\n".join(lines)


class Topology:
    """Process groups of the ``R x S`` layout, built from a 3-D DeviceMesh
    ``(replica, shard, model)`` whose ``model`` axis has size 1 (DeepSpeed's mpu needs a
    model-parallel group; the size-1 axis gives each rank its own without W extra
    ``new_group`` calls).

    Requires ``torch.distributed`` to be initialised. Every rank must construct it (the
    mesh creation is collective).
    """

    def __init__(self, replicas: int, device_type: str = "cpu") -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.layout = Layout(dist.get_world_size(), replicas, dist.get_rank())
        self.mesh = init_device_mesh(device_type, (replicas, self.layout.shard_size, 1),
                                     mesh_dim_names=("replica", "shard", "model"))
        self.replica_group = self.mesh.get_group("replica")
        self.shard_group = self.mesh.get_group("shard")
        self.model_group = self.mesh.get_group("model")
        self.world_group = dist.group.WORLD
        _wait_for_gloo_at_exit()

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    @property
    def shard_size(self) -> int:
        return self.layout.shard_size

    @property
    def replica_index(self) -> int:
        return self.layout.replica_index

    @property
    def shard_index(self) -> int:
        return self.layout.shard_index

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def mpu(self) -> "DeepSpeedMPU":
        return DeepSpeedMPU(self)


_EXIT_WAIT_S = 2.0
_exit_wait_registered = False


def _wait_for_gloo_at_exit() -> None:
    """Register :func:`_gloo_workers_settle` with ``atexit``, once per process.

    Without it a library script that just ends (the README loop, torchrun, gloo on CPU)
    can die with SIGABRT, "terminate called without an active exception", after all its
    work (measured: 2 of 20 runs when the last step is an HDET sync, 0 of 75 otherwise). A
    ``pt_gloo_runloop`` thread, preempted between finishing the last collective and
    dropping it, frees the collective's tensors after interpreter finalization has begun;
    their Python objects need the GIL, Python ends such a thread with ``pthread_exit``,
    and the unwind through ``~AsyncWork`` aborts (gdb backtrace). ``destroy_process_group``
    does not help: the groups stay referenced (DDP, this Topology) and gloo joins its
    threads only when freed. So at exit, while the interpreter is alive, wait (GIL
    released) until no gloo worker is runnable. A worker blocked on a dead peer sleeps,
    so this never waits for it; ``_EXIT_WAIT_S`` bounds the rest."""
    global _exit_wait_registered
    if not _exit_wait_registered:
        _exit_wait_registered = True
        atexit.register(_gloo_workers_settle)


def _runnable_gloo_workers() -> int:
    """How many of this process's ``pt_gloo_runloop`` threads are runnable (Linux
    ``/proc``; 0 where it cannot be read)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    running = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name_end = stat.rfind(")")  # "tid (comm) state ...": comm may hold spaces
        if stat[stat.find("(") + 1:name_end] == "pt_gloo_runloop" and stat[name_end + 2:name_end + 3] == "R":
            running += 1
    return running


def _gloo_workers_settle() -> None:
    """atexit: return once three polls 2 ms apart find no gloo worker runnable (one may sit
    briefly on a lock between two runnable spells), or after ``_EXIT_WAIT_S``."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)  # releases the GIL: the worker may need it to free the tensors
        quiet = 0 if _runnable_gloo_workers() else quiet + 1


class DeepSpeedMPU:
    """The ``mpu`` object for ``deepspeed.initialize``: data parallelism = the shard group,
    model parallelism = size 1. ZeRO-3 then partitions inside the shard group only
    (``engine.dp_world_size == S``); crossing replicas is HDET's job (DESIGN.md)."""

    def __init__(self, topology: Topology) -> None:
        self._t = topology

    def get_data_parallel_group(self):
        return self._t.shard_group

    def get_data_parallel_rank(self) -> int:
        return self._t.shard_index

    def get_data_parallel_world_size(self) -> int:
        return self._t.shard_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._t.layout.shard_group_ranks()

    def get_model_parallel_group(self):
        return self._t.model_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._t.rank
