"""Start-up of ``hdet-train``'s own launcher: ranks forked from one fork server that
imported torch, transformers' model code and the training loop once (the default,
``HDET_RANK_START=forkserver``) against ranks spawned bare, each importing them itself
(``HDET_RANK_START=spawn``) (docs/benchmarks.md, "Start-up of hdet-train's ranks").

    OMP_NUM_THREADS=1 python -m benchmarks.start_time                 # 5 pairs per backend
    python -m benchmarks.start_time --report-only                      # table from the results

Each run is a whole ``hdet-train`` job of 8 optimizer steps at the default layout (4 local
ranks: 2 replicas x 2 shards, the trainer's default model, data and ``hdet`` block, W&B,
plots and the progress bar off), so the figure is what a short job costs from the command
to its exit. The two start methods run in turn (forkserver, spawn, forkserver, ...) and
the ratio is taken pair by pair. Wall seconds are the command's; CPU seconds are the whole
machine's (``/proc/stat``: user + nice + system over all cores), because the ranks of a fork
server are not children the command waits for, so its own rusage would not count them.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RESULTS = "benchmarks/results/start_time.jsonl"
ARGS = ["train.steps=8", "deepspeed.hdet.sync_interval=3", "deepspeed.hdet.auto.warmup_steps=3",
        "train.eval_batches=4", "wandb.enabled=false", "train.progress=false", "train.plots=false"]
METHODS = ("forkserver", "spawn")


def _cpu_ticks() -> int:
    with open("/proc/stat") as f:
        user, nice, system = (int(x) for x in f.readline().split()[1:4])
    return user + nice + system


def run_once(backend: str, method: str) -> dict:
    """One ``hdet-train`` job: ``{"wall_s", "cpu_s", "rc"}``."""
    tmp = tempfile.mkdtemp(prefix="hdet_start_")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "HDET_RANK_START": method}
    cmd = [sys.executable, "-m", "hdet_scale.train.cli", f"run_dir={tmp}/run", f"backend={backend}", *ARGS]
    ticks, t0 = _cpu_ticks(), time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        wall, cpu = time.monotonic() - t0, (_cpu_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend}/{method} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "rc": proc.returncode}


def report(rows: list[dict]) -> str:
    out = ["| backend | start | wall s (median) | machine CPU s (median) | wall / spawn (min, median, max) "
           "| CPU / spawn (min, median, max) | pairs |", "|---|---|---|---|---|---|---|"]
    for backend in sorted({r["backend"] for r in rows}):
        pairs: dict[int, dict] = {}
        for r in rows:
            if r["backend"] == backend:
                pairs.setdefault(r["pair"], {})[r["method"]] = r
        full = [p for p in pairs.values() if set(p) == set(METHODS)]
        for m in METHODS:
            wall = statistics.median(p[m]["wall_s"] for p in full)
            cpu = statistics.median(p[m]["cpu_s"] for p in full)
            if m == "spawn":
                out.append(f"| {backend} | {m} | {wall:.1f} | {cpu:.1f} | 1 | 1 | {len(full)} |")
                continue
            rw = sorted(p[m]["wall_s"] / p["spawn"]["wall_s"] for p in full)
            rc = sorted(p[m]["cpu_s"] / p["spawn"]["cpu_s"] for p in full)
            out.append(f"| {backend} | {m} | {wall:.1f} | {cpu:.1f} | {rw[0]:.2f}, {statistics.median(rw):.2f}, "
                       f"{rw[-1]:.2f} | {rc[0]:.2f}, {statistics.median(rc):.2f}, {rc[-1]:.2f} | {len(full)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["ddp", "deepspeed"])
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not args.report_only:
        rows = []
        _ = run_once(args.backends[0], METHODS[0])  # warm-up: page cache, DeepSpeed's ops
        for pair in range(args.pairs):
            for backend in args.backends:
                for method in METHODS if pair % 2 == 0 else METHODS[::-1]:
                    r = {"backend": backend, "method": method, "pair": pair, **run_once(backend, method)}
                    print(json.dumps(r), flush=True)
                    rows.append(r)
        with open(RESULTS, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(RESULTS) as f:
        print(report([json.loads(line) for line in f]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
