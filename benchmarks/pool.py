"""Run benchmark specs in worker processes, one thread each, appending results to a
JSONL file as they finish; specs whose ``name`` is already in the file are skipped, so an
interrupted benchmark continues where it stopped."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from typing import Callable


def done_names(path: str) -> set[str]:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {json.loads(line)["name"] for line in f if line.strip()}


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_all(specs: list[dict], fn: Callable[[dict], dict], path: str, jobs: int) -> None:
    todo = [s for s in specs if s["name"] not in done_names(path)]
    print(f"{len(specs) - len(todo)} of {len(specs)} runs already in {path}; running {len(todo)} on {jobs} processes",
          file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs, maxtasksperchild=4) as pool, open(path, "a") as out:
        for i, res in enumerate(pool.imap_unordered(fn, todo), 1):
            out.write(json.dumps(res) + "\n")
            out.flush()
            print(f"[{i}/{len(todo)}] {res['name']}: val {res['val_loss']} ({res['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
