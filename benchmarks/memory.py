"""Memory benchmark: peak host memory per rank (VmHWM) of ``hdet-train`` on a 103M-parameter
model, with and without sharded construction (``model.sharded_init``), on DeepSpeed ZeRO-3
and FSDP2, against the same job with no sharding (S = 1). (docs/benchmarks.md)

    OMP_NUM_THREADS=1 python -m benchmarks.memory            # missing runs (~1 min each on 2 cores) + table
    OMP_NUM_THREADS=1 python -m benchmarks.memory --rerun    # all runs again
    python -m benchmarks.memory --report-only                 # table from the results

4 local CPU ranks each run; float32, AdamW, micro-batch 1 x 128 bytes, 3 optimizer steps
(the peak of a step is reached by the first; the optimizer state exists from the first
step). Results: ``benchmarks/results/memory.jsonl``, one line per run, written after each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RESULTS = "benchmarks/results/memory.jsonl"
MODEL = ["model.hidden_size=1024", "model.num_layers=8", "model.num_heads=16", "model.num_kv_heads=16",
         "model.intermediate_size=2816", "model.max_seq_len=128"]
COMMON = ["train.steps=3", "train.eval_batches=4", "train.probe_batches=1", "train.checkpoint=false",
          "wandb.enabled=false", "train.progress=false", "deepspeed.train_micro_batch_size_per_gpu=1",
          "deepspeed.gradient_accumulation_steps=1", "data.seq_len=128", "data.max_bytes=400000",
          "deepspeed.hdet.sync_interval=2", "deepspeed.hdet.auto.enabled=false", "deepspeed.hdet.schedule.name=constant"]
# (backend, replicas, sharded_init): 2 x 2 built sharded / built whole, 4 x 1 (no
# sharding: every rank holds a whole replica), and 1 x 4 built sharded / whole (where the
# whole build's construction peak, 4 B/param, exceeds the sharded state after it).
RUNS = [(b, r, s) for b in ("deepspeed", "fsdp2") for r, s in ((2, True), (2, False), (4, True), (1, True), (1, False))]


def run_one(backend: str, replicas: int, sharded: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "hdet_scale.train.cli", f"run_dir={tmp}/run", f"backend={backend}",
                f"deepspeed.hdet.replicas={replicas}", f"model.sharded_init={str(sharded).lower()}", *MODEL, *COMMON]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        with open(f"{tmp}/run/summary.json") as f:
            summary = json.load(f)
    return {"backend": backend, "replicas": replicas, "shard_size": 4 // replicas, "sharded_init": sharded,
            "params": summary["params"], "peak_host_mb": summary["peak_host_mb"],
            "peak_host_mb_after_model": summary["peak_host_mb_after_model"],
            "peak_host_mb_after_build": summary["peak_host_mb_after_build"], "wall_s": summary["wall_s"]}


def report(rows: list[dict]) -> str:
    lines = ["| backend | R x S | sharded_init | model built | engine built | whole run | "
             "weights+grads+Adam per rank, expected |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        # float32: DeepSpeed keeps the parameter partition and a separate fp32 master
        # (4 + 4 B), gradient (4 B), Adam m and v (8 B): 20 B/param; FSDP2 keeps one
        # sharded parameter (4 B) + gradient + Adam: 16 B/param. Divided by S.
        per_param = 20 if r["backend"] == "deepspeed" else 16
        expected = per_param * r["params"] / r["shard_size"] / 2 ** 20
        lines.append(f"| {r['backend']} | {r['replicas']} x {r['shard_size']} | {r['sharded_init']} | "
                     f"{statistics.mean(r['peak_host_mb_after_model']):.0f} | "
                     f"{statistics.mean(r['peak_host_mb_after_build']):.0f} | {statistics.mean(r['peak_host_mb']):.0f} "
                     f"| {expected:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--rerun", action="store_true", help="rerun the runs already in the results file")
    args = ap.parse_args()
    done = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            done = {_key(r): r for r in map(json.loads, f)}
    if not args.report_only:
        for key in RUNS:
            if key in done and not args.rerun:
                continue
            done[key] = run_one(*key)
            print(json.dumps(done[key]), flush=True)
            os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
            with open(RESULTS, "w") as f:  # after every run: an interrupted benchmark keeps what it measured
                f.writelines(json.dumps(done[k]) + "\n" for k in RUNS if k in done)
    print(report([done[k] for k in RUNS if k in done]))


def _key(row: dict) -> tuple:
    return row["backend"], row["replicas"], row["sharded_init"]


if __name__ == "__main__":
    main()
