"""What the safe read of a checkpoint costs at resume (``backends/safe_load.py``), on the
103M-parameter model of the memory benchmark (docs/benchmarks.md, "Reading a checkpoint
safely").

    OMP_NUM_THREADS=1 python -m benchmarks.checkpoint_trust    # ~3 min on 2 cores

Writes a checkpoint of that model with ``hdet-train`` (2 x 2, 4 local CPU ranks, 2 steps)
on DeepSpeed ZeRO-3 and on FSDP2, then times, in one process, interleaved and repeated,
for one replica folder (what a shard group reads between its ranks):

* ``checksums``: the CRC-32 pass every resume already makes (``manifest.manifest_problem``:
  every byte of every file read),
* ``safe read``: the pass this benchmark is about (``safe_load.folder_problem``: each pickle
  parsed by the restricted loader, tensor bytes memory-mapped),
* ``full load`` (DeepSpeed's files only): ``torch.load(weights_only=False)`` of every file,
  as DeepSpeed's engine reads them.

The page cache is warm after the first round (the times are of files in memory, the case
of a resume right after the save and the lower bound of a cold read; a cold read adds the
same disk read to every column). Results: ``benchmarks/results/checkpoint_trust.jsonl``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.memory import MODEL

RESULTS = "benchmarks/results/checkpoint_trust.jsonl"
ROUNDS = 5
RUN = ["train.steps=2", "train.checkpoint_every=2", "train.eval_batches=4", "train.probe_batches=1",
       "wandb.enabled=false", "train.progress=false", "train.plots=false",
       "deepspeed.train_micro_batch_size_per_gpu=1", "deepspeed.gradient_accumulation_steps=1", "data.seq_len=128",
       "data.max_bytes=400000", "deepspeed.hdet.sync_interval=2", "deepspeed.hdet.auto.enabled=false",
       "deepspeed.hdet.schedule.name=constant"]


def checkpoint(backend: str, root: str) -> str:
    """Train and save; returns replica 0's folder of the saved tag."""
    run_dir = os.path.join(root, backend)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "hdet_scale.train.cli", f"run_dir={run_dir}", f"backend={backend}",
                           *MODEL, *RUN], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return os.path.join(run_dir, "checkpoint", "replica_0", "global_step2")


def time_folder(folder: str, with_load: bool) -> dict:
    import torch

    from hdet_scale.backends.manifest import manifest_problem
    from hdet_scale.backends.safe_load import folder_problem

    def full_load() -> None:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".pt"):
                torch.load(os.path.join(folder, name), map_location="cpu", weights_only=False)

    passes = {"checksums": lambda: manifest_problem(folder)[0], "safe read": lambda: folder_problem(folder)}
    if with_load:
        passes["full load"] = full_load
    for fn in passes.values():  # warm the page cache; both checks must pass
        assert fn() is None
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(ROUNDS):
        for name, fn in passes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    return {"files": len(os.listdir(folder)), "mb": size / 2**20,
            **{k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}}


def main() -> None:
    import deepspeed  # noqa: F401 - DeepSpeed's types are allowed once it is imported, as in a DeepSpeed resume

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for backend in ("deepspeed", "fsdp2"):
            folder = checkpoint(backend, root)
            rows.append({"backend": backend, **time_folder(folder, with_load=backend == "deepspeed")})
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print("| backend | files | MiB | checksums (s) | safe read (s) | safe / checksums | full load (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        load = f"{r['full load'][0]:.3f}" if "full load" in r else "-"
        print(f"| {r['backend']} | {r['files']} | {r['mb']:.0f} | {r['checksums'][0]:.3f} | {r['safe read'][0]:.4f} | "
              f"{r['safe read'][0] / r['checksums'][0]:.3f} | {load} |")


if __name__ == "__main__":
    main()
