"""One quality-benchmark run: plain data parallelism or HDET with the ``Simulator`` on the
default model and corpus (docs/quality.md). Used by ``benchmarks/quality.py``.

A run is a dict ``spec``::

    {"name": ..., "kind": "plain" | "hdet", "lr": peak LR, "seed": data seed,
     "hdet": {...overrides of the hdet block...}, "steps": 200, "clip": 1.0,
     "drop": {"at": step, "factor": f}  (plain only: the LR times f from that step on),
     "two_groups": true  (AdamW with decay / no-decay parameter groups),
     "dropout": p  (the model's attention dropout; with an ``axes.dropout`` block in
                    "hdet", the value the replicas spread around)}

Layout: R = 4 replicas x 8 sequences of 128 bytes (global batch 32); plain data
parallelism is one model on the same 32 sequences per step (R = 1, the mean gradient of
the 4 replicas' data). AdamW (betas 0.9 / 0.95, weight decay 0.1), gradient-norm
clipping 1.0 per replica after gradient sharing (DeepSpeed's default), OneCycle with
``pct_start`` 0.2 and ``final_div_factor`` 10 (the default job's schedule). Fitness
probes: 2 fixed batches of 8 training sequences, the same for every replica. The model
is evaluated at the end on 32 validation batches of 8 sequences (after the last converge).

Compute is counted in sequence passes: a training sequence costs 3 (forward + backward),
a probe sequence 1 (forward only).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

REPLICAS, MICRO, SEQ = 4, 8, 128
PROBE_BATCHES, EVAL_BATCHES = 2, 32

BASE_HDET = {
    "replicas": REPLICAS, "sync_interval": 25, "gradient_sharing": "global", "seed": 0,
    "axes": {"lr": {"spread_ratio": 0.111}},
    "schedule": {"name": "onecycle", "pct_start": 0.2, "final_div_factor": 10.0},
    "auto": {"enabled": True, "warmup_steps": 25},
    "warm_init": {"enabled": True, "nu": 0.01},
}

_DATA: dict[str, Any] = {}


def _data(seed: int):
    from hdet_scale.train.data import ByteBatches, load_corpus

    if "corpus" not in _DATA:
        _DATA["corpus"] = load_corpus(None, 0.1, 4_000_000, 0)
    c = _DATA["corpus"]
    shards = [ByteBatches(c.train, SEQ, MICRO, seed, r, REPLICAS) for r in range(REPLICAS)]
    probe = ByteBatches(c.train, SEQ, MICRO, 10_000 + seed, 0, 1).eval_batches(PROBE_BATCHES)
    val = ByteBatches(c.val, SEQ, MICRO, 0, 0, 1).eval_batches(EVAL_BATCHES)
    return shards, probe, val


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips its parameters' gradient norm first (as DeepSpeed's
    ``gradient_clipping`` does after the gradient reduction)."""

    def __init__(self, params, clip: float, **kw) -> None:
        super().__init__(params, **kw)
        self.clip = clip

    def step(self, closure=None):
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.clip)
        return super().step(closure)


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _eval(model, batches) -> float:
    from hdet_scale.train.model import loss_fn

    model.eval()
    with torch.no_grad():
        total = sum(float(loss_fn(model, x, y)) for x, y in batches)
    model.train()
    return total / len(batches)


def run(spec: dict) -> dict:
    """Train one run; returns ``spec`` plus ``val_loss``, ``diverged``, ``passes``, ``wall_s``
    and, for HDET, the trace of the base-LR multiplier at each sync."""
    from hdet_scale import Simulator
    from hdet_scale.train.model import ModelConfig, build_model, loss_fn

    torch.set_num_threads(1)
    steps, seed, lr = spec.get("steps", 200), spec["seed"], spec["lr"]
    shards, probe, val = _data(seed)
    mcfg = ModelConfig(init_seed=seed, dropout=spec.get("dropout", 0.0))
    opt_kw = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    clip = spec.get("clip", 1.0)
    R = 1 if spec["kind"] == "plain" else REPLICAS
    if spec["kind"] == "plain":
        block = merge(BASE_HDET, {"replicas": 1, "axes": {"lr": {"spread_ratio": 0.0}},
                                  "auto": {"enabled": False}, "warm_init": {"enabled": False}})
    else:
        block = merge(BASE_HDET, spec.get("hdet", {}))
    block = merge(block, {"schedule": {"total_steps": steps}})
    block["sync_interval"] = min(block["sync_interval"], steps)

    def probe_fn(model, r):
        model.eval()
        loss = sum(loss_fn(model, x, y) for x, y in probe) / len(probe)
        model.train()
        return loss

    def batch(r: int, step: int):
        if R == 1:  # plain: the 4 shards' sequences together
            parts = [s.batch(step) for s in shards]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return shards[r].batch(step)

    t0 = time.perf_counter()
    def optimizer(params):
        if not spec.get("two_groups"):
            return ClippedAdamW(params, clip, **opt_kw)
        # Decay / no-decay groups, as most pretraining code builds them.
        kw = {k: v for k, v in opt_kw.items() if k != "weight_decay"}
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return ClippedAdamW(groups, clip, **kw)

    sim = Simulator(lambda: build_model(mcfg), optimizer, block,
                    probe_fn=probe_fn if spec["kind"] == "hdet" else None)
    trace, diverged = [], False
    drop = spec.get("drop")  # {"at": step, "factor": f}: the LR times f from that step on
    for step in range(steps):
        if drop and step == drop["at"]:
            # An "oracle" LR change for plain runs: the same multiplier that auto-LR moves,
            # set by hand once (the schedule keeps its shape).
            sim.scheduler.controller.log_m[("lr", 0)] = math.log(drop["factor"])
            sim.scheduler._apply()
        losses = sim.step(lambda model, r: loss_fn(model, *batch(r, step)))
        if not all(math.isfinite(float(x)) for x in losses):
            diverged = True
            break
        rec = sim.scheduler.last_sync
        if rec and rec.get("hdet/step") == step + 1:
            trace.append({"step": step + 1, "base": rec.get("hdet/lr/group_0/base"),
                          "multiplier": rec.get("hdet/lr/group_0/multiplier"),
                          "dropout": rec.get("hdet/dropout/group_0/base"),
                          "loss": sum(float(x) for x in losses) / len(losses)})
    if not diverged and sim.scheduler.converged_step != sim.scheduler.step_count:
        sim.converge()  # a run shorter than total_steps (the scheduler converges at its last step itself)
    wall = time.perf_counter() - t0
    val_loss = float("nan") if diverged else _eval(sim.models[0], val)
    syncs = steps // block["sync_interval"]
    auto = block["auto"]
    probes = 0
    if spec["kind"] == "hdet" and auto.get("enabled") and auto.get("fitness", "probe") == "probe":
        first = max(math.ceil(auto.get("warmup_steps", 0) / block["sync_interval"]), 1)
        probes = max(syncs - first + 1, 0) * R * PROBE_BATCHES * MICRO
    passes = 3 * steps * REPLICAS * MICRO + probes
    return {**spec, "val_loss": val_loss if math.isfinite(val_loss) else None, "diverged": diverged or not math.isfinite(val_loss),
            "passes": passes, "probe_passes": probes, "wall_s": wall, "trace": trace}
