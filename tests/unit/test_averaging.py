"""``averaging.mean_all_reduce_``: exact means, collective counts and extra memory.

Real gloo process groups of 1-3 ranks, one thread per rank in this process
(``ProcessGroupGloo`` over a shared ``HashStore``; the collectives release the GIL), so
no default process group is created and no process is spawned.

Exactness: the inputs are multiples of a power of two small enough that every partial
sum of up to 3 of them is exact in float32 (fp32 tensors: k * 2^-10, |k| < 2^20; fp16 /
bf16: k * 2^-4, |k| <= 128, exact in both). The all-reduce's summation order then cannot
matter, and the only rounding left is the division by n (and, for fp16 / bf16, the cast
back): the result must equal the plain mean ``(sum in float32) / n -> dtype`` **bit for
bit**, on every rank. n = 3 makes the division round (n = 2 would be exact).

Memory: what the call allocates through torch's allocator, read from
``torch.profiler``'s memory events (every allocation and free, including temporaries
inside kernels), as the peak of the running sum of bytes allocated minus freed during
the call. The bound is exact: one bucket (``min(bucket, streamed elements)`` x 4 bytes)
on a first call, 0 with a reused :class:`BucketBuffer` and for a tensor reduced in place,
up to the 0-dim tensors (<= 16 B) torch wraps the divisor in for an instant.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from hdet_scale.averaging import BucketBuffer, mean_all_reduce_


def on_ranks(n: int, fn: Callable[[int, Any], Any]) -> list[Any]:
    """``fn(rank, group)`` on n threads, each holding rank ``rank`` of one gloo group."""
    store = dist.HashStore()
    groups: list[Any] = [None] * n
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def make(r: int) -> None:
        groups[r] = dist.ProcessGroupGloo(store, r, n)

    def run(r: int) -> None:
        try:
            out[r] = fn(r, groups[r])
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    for target in (make, run):
        threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return out


def exact_values(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values whose sums of up to 3 are exact in float32 (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.float16, torch.bfloat16):
        return (torch.randint(-128, 129, shape, generator=g).float() / 16).to(dtype)
    return (torch.randint(-(2 ** 20) + 1, 2 ** 20, shape, generator=g).to(torch.float64) / 1024).to(dtype)


# (shape, dtype, layout): small, large (in place), low precision larger than a bucket,
# non-contiguous (a transpose) larger than a bucket, 0-dim, empty, float64.
BUCKET_BYTES = 256  # 64 float32 elements
SCALAR_SLACK = 32
SPECS = [((5,), torch.float32, "c"), ((300,), torch.float32, "c"), ((7, 3), torch.float32, "c"),
         ((500,), torch.bfloat16, "c"), ((3, 2), torch.float16, "c"), ((40, 9), torch.float32, "t"),
         ((30, 7), torch.bfloat16, "t"), ((), torch.float32, "c"), ((0, 4), torch.float32, "c"),
         ((20,), torch.float64, "c"), ((100,), torch.float64, "c"), ((2, 70), torch.bfloat16, "t")]


def make_tensors(seed: int) -> list[torch.Tensor]:
    out = []
    for i, (shape, dtype, layout) in enumerate(SPECS):
        if layout == "t":
            t = exact_values(shape[::-1], dtype, seed * 100 + i).t()
            assert not t.is_contiguous() or t.numel() <= 1
        else:
            t = exact_values(shape, dtype, seed * 100 + i)
        out.append(t)
    return out


def plain_mean(per_rank: list[list[torch.Tensor]], keep: list[bool]) -> list[torch.Tensor]:
    """Sum the kept ranks' tensors in float32 (float64 stays float64), divide, cast back."""
    n = sum(keep)
    means = []
    for ts in zip(*per_rank):
        acc = torch.float64 if ts[0].dtype == torch.float64 else torch.float32
        total = sum(t.to(acc) for t, k in zip(ts, keep) if k)
        means.append((total / n).to(ts[0].dtype))
    return means


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # gloo carries CUDA tensors too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", [[True, True, True], [True, False, True]], ids=["all", "rank1-left-out"])
def test_mean_is_exact_on_every_rank(keep: list[bool], device: str) -> None:
    """Every layout and dtype path (in place, streamed and split across buckets, cast,
    non-contiguous cut along dims) gives the plain mean bit for bit on all 3 ranks; a rank
    that does not contribute still receives it. The inputs are checked to differ from the
    mean, so a call that did nothing would fail. The plain mean is computed on the same
    device (CUDA divides by a scalar as a multiplication by its reciprocal, CPU does not;
    the simulator, the oracle of the distributed tests, runs on the device too)."""
    inputs = [[t.to(device) for t in make_tensors(seed)] for seed in range(3)]
    expected = plain_mean(inputs, keep)

    def work(r: int, group: Any) -> list[torch.Tensor]:
        tensors = [t.clone() if t.is_contiguous() else t.t().clone().t() for t in inputs[r]]
        mean_all_reduce_(tensors, group, BUCKET_BYTES, contribute=keep[r], contributors=sum(keep))
        return tensors

    results = on_ranks(3, work)
    for r, got in enumerate(results):
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g, e), f"rank {r}, tensor {i} {SPECS[i]}: max diff {(g.double() - e.double()).abs().max()}"
    assert sum(not torch.equal(a, e) for a, e in zip(inputs[0], expected)) >= len(SPECS) - 3  # 0-dim/empty may tie


def expected_calls(tensors: list[torch.Tensor], bucket_bytes: int) -> int:
    """The count the module docstring promises for contiguous tensors."""
    calls = 0
    for acc in (torch.float32, torch.float64):
        group = [t for t in tensors if t.numel() and (torch.float64 if t.dtype == torch.float64 else torch.float32) == acc]
        cap = bucket_bytes // acc.itemsize
        in_place = [t for t in group if t.dtype == acc and t.numel() >= cap]
        streamed = sum(t.numel() for t in group if not any(t is x for x in in_place))
        calls += len(in_place) + math.ceil(streamed / cap)
    return calls


def counted_allreduces(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``(fn(), all-reduces seen by the profiler, peak bytes allocated net of frees)``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = fn()
    events = prof.profiler.kineto_results.events()
    calls = sum(1 for e in events if e.name() == "gloo:all_reduce")  # gloo's own record of each collective
    running = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return value, calls, peak


def test_collective_count_and_extra_memory() -> None:
    """One rank (the count and the allocations do not depend on the group size): the
    returned count equals the docstring's formula and the all-reduces the profiler saw;
    the call allocates one bucket, then nothing once the bucket is reused; a large fp32
    tensor alone allocates nothing. The old implementation (``torch.cat`` of float32
    copies) would allocate 2x the bf16 tensor here: 10 buckets."""
    tensors = [t.clone() for t in make_tensors(0) if t.is_contiguous()]
    # in place: fp32 (300,), fp64 (100,); streamed: 533 float32 elements, 20 float64 ones
    assert expected_calls(tensors, BUCKET_BYTES) == 2 + math.ceil((5 + 21 + 500 + 6 + 1) / 64) + 1

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)  # in this thread: the profiler records this one
    buf = BucketBuffer()
    first = counted_allreduces(lambda: mean_all_reduce_(tensors, group, BUCKET_BYTES, buffer=buf))
    second = counted_allreduces(lambda: mean_all_reduce_(tensors, group, BUCKET_BYTES, buffer=buf))
    held = buf.nbytes
    big_bf16 = torch.zeros(64 * 10, dtype=torch.bfloat16)
    low = counted_allreduces(lambda: mean_all_reduce_([big_bf16], group, BUCKET_BYTES))
    big_fp32 = torch.zeros(64 * 10)
    in_place = counted_allreduces(lambda: mean_all_reduce_([big_fp32], group, BUCKET_BYTES))
    n_calls = expected_calls(tensors, BUCKET_BYTES)
    assert first[0] == first[1] == n_calls and second[0] == second[1] == n_calls
    assert held == BUCKET_BYTES + 20 * 8  # a full float32 bucket, a float64 one of the 20 elements it needs
    # SCALAR_SLACK: torch wraps the Python divisor into a 0-dim tensor per division (8 B,
    # plus 4-8 B converting it), freed at once: measured 16 B at most alive together.
    assert held <= first[2] <= held + SCALAR_SLACK  # allocated once ...
    assert second[2] <= SCALAR_SLACK  # ... and reused
    assert low[0] == low[1] == 10 and BUCKET_BYTES <= low[2] <= BUCKET_BYTES + SCALAR_SLACK  # 10 buckets through one
    assert in_place[0] == in_place[1] == 1 and in_place[2] <= SCALAR_SLACK


def test_persistent_float_buffers_follow_state_dict() -> None:
    """The buffers converge averages are exactly the floating ``state_dict`` buffers, in
    ``named_buffers`` order, each once: not a non-persistent one (a rotary table), not an
    integer one (BatchNorm's step count), a shared one once, a ``None`` one skipped."""
    from hdet_scale.averaging import persistent_float_buffers

    m = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    m[1].register_buffer("rope", torch.ones(2), persistent=False)
    m[1].register_buffer("stat", torch.ones(2))
    m[1].register_buffer("absent", None)
    m[2].running_mean = m[0].running_mean  # shared between two modules
    persistent = set(m.state_dict().keys())
    expected = [b for n, b in m.named_buffers() if n in persistent and b.is_floating_point()]
    got = persistent_float_buffers(m)
    assert len(got) == len(expected) == 4 and all(a is b for a, b in zip(got, expected))
