"""Cost model of an ``R x S`` HDET run: memory per rank and bytes per rank on the wire.

Pure arithmetic (no ``torch.distributed``), for a world you do not have (``hdet-dryrun
--params 7B``). Figures are for global rank 0; ``P`` = parameters, ``p`` = rank 0's local
share of them (below), ``S`` = shard size, ``R`` = replicas, ``W = R x S``.

Local share ``p`` per engine (exact when the parameter shapes are known, e.g. from a
Hugging Face config; ``ceil(P / S)`` from a bare count):

- deepspeed: ``sum ceil(n_i / S)`` (ZeRO-3 pads every parameter to a multiple of S,
  ``partition_parameters._padding_size``, and concatenates the partitions);
- fsdp2: ``sum ceil(d0_i / S) x (n_i / d0_i)`` (FSDP2 chunks dim 0; rank 0 always holds a
  full chunk, equal to the padded chunk every rank reduces);
- fairscale: the tensors OSS assigns rank 0 (whole tensors, each to the rank with the
  fewest elements so far: ``OSS.partition_parameters``), for the optimizer state only;
- ddp: ``P``.

Memory per rank, bytes (fp32 / bf16 with fp32 masters), activations and the engines'
communication buffers not included (they are the constant of docs/benchmarks.md):

- deepspeed: weights 4p (bf16: 2p) working partition + 4p fp32 master (a separate copy
  even in fp32: stage3.py clones the partition unless its device equals a device *name*,
  which a ``torch.device`` never does, deepspeed 0.19); gradients 4p (bf16: 2p, the
  ``grad_partitions_flat_buffer`` in ``grad_accum_dtype`` = the model dtype); Adam 8p.
  20 B / param / S in fp32, 16 in bf16 (the ZeRO paper's 2 + 2 + 12).
- fsdp2: weights 4p (the fp32 sharded parameter is the master; bf16 is only the
  all-gathered copy, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` as
  hdet-train sets it); gradients 4p; Adam 8p. 16 B / param / S either way.
- ddp: weights 4P; gradients 8P (the gradients plus DDP's bucket copy of them:
  ``gradient_as_bucket_view=False``, torch's default); Adam 8P.
- fairscale: weights 4P; gradients 8P (DDP as above); Adam 8 x rank 0's OSS share.
- HDET's own: one reusable bucket of at most ``hdet.bucket_mb`` per dtype.

Communication per rank. *Payload*: bytes of the tensor a rank hands to the collective
(all-gather: the gathered output), summed over the collectives of one occurrence; the
tests count it on real gloo runs. *Sent*: what one rank sends in a ring algorithm, for a
group of n ranks: all-reduce ``2 (n-1)/n x payload``, reduce-scatter and all-gather
``(n-1)/n x payload``. Groups of one rank send nothing and are left out. HDET averages
in float32 whatever the tensor's dtype (:mod:`hdet_scale.averaging`), in one or more
bucketed all-reduces of the same total payload.

- converge, every ``T`` steps, replica group, all-reduce: ``4 x (p + buffers)``
  (deepspeed: the flat fp32 master partitions; fsdp2: the local fp32 shards; ddp: every
  parameter; fairscale: the OSS share; plus the persistent floating buffers, whole).
  deepspeed's refresh then re-gathers the small persistent parameters (not modelled).
- gradient sharing, every step: deepspeed "global": HDET's hook all-reduces the flat
  gradient partition (``4p``, fp32) over the replica group; fsdp2 "global": HSDP's
  all-reduce of the reduce-scattered fp32 gradient over the replica group (``4p``);
  ddp / fairscale: DDP's all-reduce of every gradient (``4P``) over the world
  ("global") or the shard group ("replica"); "replica" on deepspeed / fsdp2: nothing
  crosses replicas.
- the engine's own, inside the shard group (approximate, overlapped with compute):
  ZeRO-3 / FSDP2 all-gather the parameters twice per micro-batch (forward, backward) in
  the working dtype; ZeRO-3 reduce-scatters gradients every micro-batch in the gradient
  dtype, FSDP2 once per step in fp32 (hdet-train syncs the last micro-batch only);
  fairscale's OSS broadcasts the updated shards after each step (as an all-gather).
"""

from __future__ import annotations

from typing import Any

import math
import os
import re
from dataclasses import dataclass

from hdet_scale.ds_json import RepeatedKeyError, loads_json
from hdet_scale.errors import HDETConfigError
from hdet_scale.hf_sizes import degenerate_size_keys, join_and
from hdet_scale.paths import require_regular

BACKENDS = ("deepspeed", "fsdp2", "ddp", "fairscale")
PRECISIONS = ("fp32", "bf16")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class ModelSize:
    """Parameter count ``params`` (elements), the parameter ``shapes`` when known (for
    exact local shares), the persistent floating buffers' elements, and where it came from."""

    params: int
    shapes: tuple[tuple[int, ...], ...] | None = None
    buffer_numel: int = 0
    source: str = "--params"


MAX_PARAMS = 10 ** 15  # a thousand times today's largest models: beyond, a typo
MAX_WORLD = 2 ** 24  # ranks; ~100x today's largest jobs: beyond, a typo and figures that mean nothing


def parse_count(text: str, option: str = "--params") -> int:
    """``"7e9"``, ``"7B"``, ``"1.3b"``, ``"125M"``, ``"350k"`` or ``"7000000000"`` -> an
    integer >= 1. Raises HDETConfigError naming ``option``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()] if m else math.nan
    if not math.isfinite(value) or value < 1 or value != round(value) or value > MAX_PARAMS:
        raise HDETConfigError(f"{option}: expected a whole number of parameters in [1, {MAX_PARAMS:.0e}] such as "
                              f"7e9, 7B or 125M, got {text!r}")
    return round(value)


def positive(text: str, option: str, low: float = 1e-6, high: float = 1e9) -> float:
    """``text`` as a float in ``[low, high]`` (the range where the printed figures mean
    something: 1e-300 Gbit/s printed "1.6e+301 s"); HDETConfigError naming ``option``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or not low <= value <= high:
        raise HDETConfigError(f"{option}: expected a number in [{low:g}, {high:g}], got {text!r}")
    return value


def size_of_module(module) -> ModelSize:
    """Parameter shapes and persistent floating buffers of a built ``torch.nn.Module``
    (shared parameters counted once, as ``parameters()`` yields them)."""
    from hdet_scale.averaging import persistent_float_buffers

    shapes = tuple(tuple(p.shape) for p in module.parameters() if p.is_floating_point())
    return ModelSize(sum(math.prod(s) for s in shapes), shapes,
                     sum(b.numel() for b in persistent_float_buffers(module)), type(module).__name__)


def size_of_hf_config(config: str | os.PathLike | dict) -> ModelSize:
    """The size of the model a Hugging Face config builds (:func:`hf_model`). Raises
    HDETConfigError naming ``--hf-config``."""
    model, model_type, source = hf_model(config)
    size = size_of_module(model)
    return ModelSize(size.params, size.shapes, size.buffer_numel, f"{model_type}, {source}")


#: The most decoder layers ``--hf-config`` builds (a few seconds on the meta device).
MAX_HF_LAYERS = 2000

def hf_model(config: str | os.PathLike | dict) -> tuple[Any, str, str]:
    """``(model, model_type, source)``: the model a Hugging Face config builds
    (``AutoModelForCausalLM.from_config`` on the meta device: no weights allocated,
    nothing downloaded). ``config``: a ``config.json`` path, a folder holding one, or its
    dict (with ``model_type``). Raises HDETConfigError naming ``--hf-config``."""
    source = "config dict"
    try:
        if not isinstance(config, dict):
            source = os.fspath(config)
            path = os.path.join(source, "config.json") if os.path.isdir(source) else source
            require_regular(path, "--hf-config:")  # a FIFO's open would wait forever
            with open(path, encoding="utf-8") as f:
                config = loads_json(f.read())  # a key twice is refused, not the last one kept
        if not isinstance(config, dict):  # not "cannot convert dictionary update sequence"
            raise HDETConfigError(f"--hf-config: {source!r} must hold a JSON object (a Hugging Face config.json), "
                                  f"got a {type(config).__name__}")
        config = dict(config)
        model_type = config.pop("model_type")
    except HDETConfigError:
        raise
    except RepeatedKeyError as e:
        raise HDETConfigError(f"--hf-config: {source!r} has the key {e.key!r} twice in one object: keep one "
                              "(Python's json would keep the last silently)") from None
    except (OSError, ValueError, TypeError, KeyError) as e:
        what = "no model_type key" if isinstance(e, KeyError) else e
        raise HDETConfigError(f"--hf-config: cannot read a Hugging Face config from {source!r}: {what}") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    bad = degenerate_size_keys(config, model_type)
    degenerate = bad and HDETConfigError(
        f"--hf-config: {source!r} has {join_and([f'{k}={v}' for k, v, _ in bad])}: a causal LM needs "
        f"{join_and(list(dict.fromkeys(need for _, _, need in bad)))}")
    if any(0 <= v < 1 for _, v, _ in bad):
        # a 0 is refused before AutoConfig, which would print "bos_token_id
        # must be ... within the vocabulary" warnings and then build the degenerate model
        raise degenerate
    try:
        hf = AutoConfig.for_model(model_type, **config)
        layers = getattr(hf, "num_hidden_layers", None)
        if isinstance(layers, int) and layers > MAX_HF_LAYERS:
            # 100,000 layers would build for 149 s without a line of output
            raise HDETConfigError(f"--hf-config: {source!r} has num_hidden_layers={layers}: the dry run builds the "
                                  f"model (on the meta device, about 1.5 ms a layer) and takes at most "
                                  f"{MAX_HF_LAYERS} (released models have under 200); for a larger model give "
                                  "--params N instead")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        if bad:
            # only negatives are left: where transformers refuses one ("negative dimension",
            # tests/distributed/test_bad_inputs.py) its message stands; one it builds from
            # (num_hidden_layers=-3: no layers) is refused here
            raise degenerate
    except HDETConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad value fails anywhere in transformers or torch, with any type
        # the head says why (an unknown model_type's message ends in the list of known ones)
        reason = " ".join(str(e).split())
        reason = reason if len(reason) <= 300 else reason[:300] + " ..."
        raise HDETConfigError(f"--hf-config: {source!r} does not build a causal LM: {type(e).__name__}: "
                              f"{reason}") from None
    return model, model_type, source


def local_share(size: ModelSize, backend: str, shards: int) -> int:
    """Rank 0's local parameter elements ``p`` (module docstring)."""
    S = shards
    if backend == "ddp" or S == 1:
        return size.params
    if size.shapes is None:
        return -(-size.params // S)
    if backend == "deepspeed":
        return sum(-(-math.prod(s) // S) for s in size.shapes)
    if backend == "fsdp2":
        return sum(-(-(s[0] if s else 1) // S) * math.prod(s[1:]) for s in size.shapes)
    owned = [0] * S  # fairscale OSS: in order, each tensor to the least-loaded rank
    for s in size.shapes:
        owned[owned.index(min(owned))] += math.prod(s)
    return owned[0]


@dataclass(frozen=True)
class Transfer:
    """One kind of collective of rank 0: ``count`` times ``per`` ("sync", "step" or
    "micro-batch"), each carrying ``payload`` bytes (module docstring) on a group of
    ``n`` ranks."""

    what: str
    collective: str
    group: str
    n: int
    per: str
    count: int
    payload: int
    hdet: bool

    @property
    def sent(self) -> float:
        """Bytes rank 0 sends per occurrence, by a ring algorithm."""
        factor = 2 if self.collective == "all-reduce" else 1
        return factor * (self.n - 1) / self.n * self.payload * self.count


@dataclass(frozen=True)
class Cost:
    """Memory per rank (bytes) and the transfers of rank 0; see :func:`estimate`."""

    backend: str
    precision: str
    world_size: int
    replicas: int
    sync_interval: int
    micro_batches: int
    size: ModelSize
    local: int
    weights: int
    gradients: int
    optimizer: int
    bucket_bytes: int
    transfers: tuple[Transfer, ...]

    def per_step(self, t: Transfer) -> float:
        """Occurrences of ``t`` per optimizer step (converge: ``1 / T``)."""
        return {"sync": 1 / self.sync_interval, "step": 1, "micro-batch": self.micro_batches}[t.per]


def estimate(size: ModelSize, *, backend: str, precision: str, world_size: int, replicas: int,
             gradient_sharing: str = "global", sync_interval: int = 1, micro_batches: int = 1,
             bucket_bytes: int = 25 * 2**20, overlapped: bool = False) -> Cost:
    """Memory per rank and rank 0's collectives (module docstring for every formula).
    ``overlapped``: DeepSpeed's gradient sharing runs during the backward pass
    (``backends/ds_overlap.py``), so it is not counted as exposed.

    Raises HDETConfigError: an unknown backend or precision, bf16 on ddp / fairscale
    (hdet-train trains them in fp32), or ``replicas`` not dividing ``world_size``."""
    if backend not in BACKENDS:
        raise HDETConfigError(f"--backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if precision not in PRECISIONS:
        raise HDETConfigError(f"--precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16" and backend in ("ddp", "fairscale"):
        raise HDETConfigError(f"--precision: bf16 with fp32 masters is not a mode of the {backend} backend "
                              "(hdet-train trains it in fp32); use fp32, or fsdp2 / deepspeed")
    if world_size > MAX_WORLD:
        raise HDETConfigError(f"--world-size: the cost model covers worlds up to {MAX_WORLD:,} ranks, got "
                              f"{world_size:,}")
    if replicas < 1 or world_size % replicas:
        raise HDETConfigError(f"hdet.replicas: {replicas} does not divide the world of {world_size} ranks")
    R, S, W, P = replicas, world_size // replicas, world_size, size.params
    p = local_share(size, backend, S)
    work = 2 if precision == "bf16" else 4  # bytes of the working copy of a parameter
    full = backend in ("ddp", "fairscale")
    if backend == "deepspeed":
        weights, grads, opt = (work + 4) * p, work * p, 8 * p
    elif backend == "fsdp2":
        weights, grads, opt = 4 * p, 4 * p, 8 * p
    else:
        weights, grads, opt = 4 * P, 8 * P, 8 * p
    t: list[Transfer] = []

    def add(*args) -> None:  # a group of one rank sends nothing: left out
        if args[3] > 1 and args[6]:
            t.append(Transfer(*args))

    converge = 4 * ((P if backend == "ddp" else p) + size.buffer_numel)
    add("converge", "all-reduce", "replica", R, "sync", 1, converge, True)
    if full:
        group, n = ("world", W) if gradient_sharing == "global" else ("shard", S)
        add("gradient sharing (DDP)", "all-reduce", group, n, "step", 1, 4 * P, False)
    elif gradient_sharing == "global":
        what = ("gradient sharing (HSDP)" if backend != "deepspeed" else
                "gradient sharing (overlapped)" if overlapped else "gradient sharing (HDET hook)")
        add(what, "all-reduce", "replica", R, "step", 1, 4 * p, backend == "deepspeed" and not overlapped)
    if not full:
        add("engine: parameters", "all-gather", "shard", S, "micro-batch", 2, work * p * S, False)
        if backend == "deepspeed":
            add("engine: gradients", "reduce-scatter", "shard", S, "micro-batch", 1, work * p * S, False)
        else:
            add("engine: gradients", "reduce-scatter", "shard", S, "step", 1, 4 * p * S, False)
    elif backend == "fairscale":
        add("engine: OSS broadcast", "all-gather", "shard", S, "step", 1, 4 * P, False)
    return Cost(backend, precision, W, R, sync_interval, micro_batches, size, p, weights, grads, opt,
                bucket_bytes, tuple(t))


def build_fake_groups(world_size: int, replicas: int) -> tuple[int, int, float]:
    """Build the real :class:`~hdet_scale.topology.Topology` (its DeviceMesh and process
    groups) for rank 0 of ``world_size`` ranks, in this process, on torch's fake backend
    (as torchtitan's dry run does); returns ``(replica group size, shard group size,
    seconds)``. The process group is destroyed before returning, also on error.

    ``torch.testing._internal.distributed.fake_pg`` is a private module (torch 2.13;
    torchtitan relies on it too); RuntimeError if it is missing or a process group is
    already initialised in this process."""
    import time

    import torch.distributed as dist

    from hdet_scale.topology import Topology

    if dist.is_initialized():
        raise RuntimeError("--build-groups: a process group is already initialised in this process")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise RuntimeError(f"--build-groups: torch's fake process group is not available here ({e})") from None
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        topo = Topology(replicas)
        sizes = dist.get_world_size(topo.replica_group), dist.get_world_size(topo.shard_group)
    finally:
        dist.destroy_process_group()
    return sizes[0], sizes[1], time.perf_counter() - t0


# Worlds above this are not built by --build-groups: the mesh build is linear in W
# (measured: 0.2 s at 16384 ranks, 2.2 s and 0.4 GB at 2^18, 12 s and 1 GB at 2^20).
MAX_FAKE_WORLD = 2**18


def check_options(params: str | None = None, hf_config: str | None = None, precision: str | None = None,
                  bandwidth_gbps: str | None = None, step_seconds: str | None = None) -> dict:
    """``hdet-dryrun``'s cost options, parsed and checked before the config is read:
    ``{}`` when none is given. Raises HDETConfigError naming the option."""
    if params is not None and hf_config is not None:
        raise HDETConfigError("--params: give --params or --hf-config, not both")
    given = {"--precision": precision, "--bandwidth-gbps": bandwidth_gbps, "--step-seconds": step_seconds}
    if params is None and hf_config is None:
        for option, value in given.items():
            if value is not None:
                raise HDETConfigError(f"{option}: the cost model needs the model size: add --params N or --hf-config PATH")
        return {}
    if precision is not None and precision not in PRECISIONS:
        raise HDETConfigError(f"--precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if step_seconds is not None and bandwidth_gbps is None:
        raise HDETConfigError("--step-seconds: a share of the step needs --bandwidth-gbps X")
    return {"params": None if params is None else parse_count(params), "hf_config": hf_config,
            "precision": precision,
            "bandwidth_gbps": None if bandwidth_gbps is None else positive(bandwidth_gbps, "--bandwidth-gbps", 1e-3, 1e6),
            "step_seconds": None if step_seconds is None else positive(step_seconds, "--step-seconds", 1e-6, 1e7)}


def groups_line(world_size: int, replicas: int) -> str:
    """``--build-groups``: one line saying what was built (or why not)."""
    if world_size > MAX_FAKE_WORLD:
        return (f"process groups: not built for {world_size} ranks (limit {MAX_FAKE_WORLD}: the mesh build takes "
                "time and memory in proportion to the world, ~12 s and 1 GB at 2^20 ranks)")
    r, s, seconds = build_fake_groups(world_size, replicas)
    return (f"process groups: built on torch's fake backend for rank 0 of {world_size} (DeviceMesh replica x "
            f"shard x model = {replicas} x {world_size // replicas} x 1): replica group {r} ranks, shard group "
            f"{s} ranks, in {seconds:.2g} s")
