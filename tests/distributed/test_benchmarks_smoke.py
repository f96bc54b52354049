"""``python -m benchmarks.comm --tiny`` runs and prints sane numbers (not a timed test).

One launch of 4 gloo ranks: every backend x fp32 / bf16 x layouts 2 x 2 and 4 x 1, on a
model of 10 parameters + 2 buffers (d = 16), 1 KiB buckets so that paths span several
buckets, 2 repeats (~25 s on 2 idle cores). Times are not checked beyond being positive
and finite (the machine is shared); what is checked is exact:

- the all-reduces the profiler counts for converge's averaging step and for the
  gradient-sharing hook equal the count ``hdet_scale.averaging`` documents, computed by
  the benchmark from the tensors' sizes alone (> 1 for the bf16 gradient partition: it
  goes through the bucket in several slices);
- refresh issues one all-gather for all persistent parameters on DeepSpeed with S = 2
  (10 here; backends/ds_gather.py), nothing with S = 1, nothing on FSDP2 / DDP, and on fairscale
  one broadcast per shard rank's bucket (2 with S = 2, none with S = 1);
- extra memory: at most one bucket on a first call, and nothing but the divisor's 0-dim
  scalars (<= ``SLACK`` bytes) once the bucket is kept: the bf16 gradient partition
  (2 buckets' worth in float32) is never copied whole; the bound has teeth because DDP's
  first call is seen allocating a whole bucket (its tensors exceed one);
- the sizes the ratios rest on: DDP averages exactly the model's 12 tensors, whose bytes
  are the parameter and buffer count x the dtype's size, and the flat reference carries
  the same number of elements (in float32).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("fairscale")

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLACK = 64  # bytes: torch wraps the Python divisor in 0-dim tensors, freed at once (16 B seen)
D = 16
PARAMS = 2 * (D * D + D + 2 * D) + 2 * D  # 2 blocks of Linear + LayerNorm, BatchNorm weight and bias
BUFFERS = 2 * D  # BatchNorm running mean and variance


@pytest.fixture(scope="module")
def records() -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.comm", "--tiny", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(line[len("RECORD "):]) for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    assert "### Time, ratio" in proc.stdout and "### Collectives" in proc.stdout  # the tables are printed
    return out


def test_every_backend_layout_and_dtype_is_measured(records: list[dict]) -> None:
    got = sorted((r["layout"], r["dtype"], r["backend"]) for r in records)
    assert got == sorted((lay, dt, b) for lay in ("2x2", "4x1") for dt in ("fp32", "bf16")
                         for b in ("deepspeed", "fsdp2", "ddp", "fairscale"))
    for r in records:
        for name, times in r["times_ms"].items():
            assert len(times) == 2 and all(0 < t < 60_000 for t in times), (name, times)
        for label, (lo, med, hi) in r["ratios"].items():
            assert all(math.isfinite(x) and x > 0 for x in (lo, med, hi)) and lo <= med <= hi, label
        if r["backend"] == "ddp":
            size = 4 if r["dtype"] == "fp32" else 2
            assert r["tensors"] == 12 and r["local_bytes"] == (PARAMS + BUFFERS) * size
            assert r["message_bytes"] == 4 * (PARAMS + BUFFERS)


def _allreduces(p: dict) -> int:
    assert set(p["collectives"]) <= {"allreduce_"}, p["collectives"]
    return p["collectives"].get("allreduce_", 0)


def test_collective_counts_are_exact(records: list[dict]) -> None:
    for r in records:
        p, where = r["profiled"], (r["layout"], r["dtype"], r["backend"])
        assert r["predicted"]["average"] is not None, where
        assert _allreduces(p["average_first"]) == _allreduces(p["average"]) == r["predicted"]["average"], where
        S = r["shard_size"]
        # DeepSpeed: one all-gather for all 10 persistent parameters of the tiny model
        # (backends/ds_gather.py; DeepSpeed's own gather issues one per parameter)
        expected_refresh = {"deepspeed": {"allgather_": 1} if S > 1 else {},
                            "fsdp2": {}, "ddp": {},
                            "fairscale": {"broadcast_": S} if S > 1 else {}}[r["backend"]]
        assert p["refresh"]["collectives"] == expected_refresh, where
        if r["backend"] == "deepspeed":
            assert r["grad_dtype"] == ("bfloat16" if r["dtype"] == "bf16" else "float32"), where
            assert _allreduces(p["hook_first"]) == _allreduces(p["hook"]) == r["predicted"]["hook"], where
            if r["dtype"] == "bf16":
                assert r["predicted"]["hook"] == math.ceil(2 * r["grad_bytes"] / r["bucket_bytes"]) > 1, where


def test_extra_memory_is_at_most_one_bucket(records: list[dict]) -> None:
    for r in records:
        p, bucket, where = r["profiled"], r["bucket_bytes"], (r["layout"], r["dtype"], r["backend"])
        assert p["average_first"]["extra_bytes"] <= bucket + SLACK, where
        assert p["average"]["extra_bytes"] <= SLACK, where
        assert r["held_bucket_bytes"] <= bucket, where
        if r["backend"] == "ddp":
            assert p["average_first"]["extra_bytes"] >= bucket, where
        if "hook" in p:
            assert p["hook_first"]["extra_bytes"] <= bucket + SLACK, where
            assert p["hook"]["extra_bytes"] <= SLACK, where


def test_the_step_time_benchmark_runs_every_variant() -> None:
    """``python -m benchmarks.step_time --tiny`` (the suite checks that the
    benchmarks run, at a tiny size; times are not checked beyond being positive and
    finite). Three variants (both engines; the rest differ by a flag) are timed in each
    of the 2 repeats; ``ds_global`` shared its
    gradients overlapped with the backward pass (``ds_overlap.py``) and ``ds_global_hook``
    did not, so the table compares the two paths it claims to."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the variants the overlap claim rests on, and one FSDP2 pair: every engine builder
    # runs (the others differ from these by a flag), at a third of the full list's time
    picked = ["ds_global", "ds_global_hook", "fsdp2_global"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_time", "--tiny", "--variants", ",".join(picked)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rec = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"size"')))
    assert sorted(rec["step_s"]) == sorted(picked)
    assert all(len(t) == 2 and all(math.isfinite(x) and x > 0 for x in t) for t in rec["step_s"].values())
    assert rec["overlapped"]["ds_global"] and not rec["overlapped"]["ds_global_hook"], rec["overlapped"]
    assert "| ds_global_hook |" in proc.stdout
