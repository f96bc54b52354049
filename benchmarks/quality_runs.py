"""One quality-benchmark run: plain data parallelism or HDET with the ``Simulator`` on the
default model and corpus (docs/quality.md). Used by ``benchmarks/quality.py``.

A run is a dict ``spec``::

    {"name": ..., "kind": "plain" | "hdet", "lr": peak LR, "seed": data seed,
     "hdet": {...overrides of the hdet block...}, "steps": 200, "clip": 1.0,
     "optimizer": "adamw" | "schedulefree" | "prodigy"  (optimizer_class; default adamw),
     "device": "cpu" | "cuda", "model_size": "default" | "small" | "large" (MODEL_SIZES),
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

The peers users pick instead of a tuned AdamW, with the same clipping and batches:
schedule-free AdamW (``schedulefree.AdamWScheduleFree``: its own linear warm-up over 20 %
of the steps, our schedule constant, evaluated at its averaged iterate) and Prodigy
(``prodigyopt.Prodigy``, lr 1 under the OneCycle shape above, decoupled weight decay).

Compute is counted in sequence passes: a training sequence costs 3 (forward + backward),
a probe sequence 1 (forward only).
"""

from __future__ import annotations

import contextlib
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


#: ModelConfig fields per ``--model-size`` ("default": the trainer's 0.84M-parameter model;
#: "large", ~25M parameters, is meant for a GPU).
MODEL_SIZES = {
    "small": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 176},
    "default": {},
    "large": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1408},
}


def clipped(cls: type) -> type:
    """``cls`` (an optimizer class) that clips its parameters' gradient norm to ``clip``
    before each step, as DeepSpeed's ``gradient_clipping`` does after the reduction."""

    class Clipped(cls):
        def __init__(self, params, clip: float, **kw) -> None:
            super().__init__(params, **kw)
            self.clip = clip

        def step(self, closure=None):
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], self.clip)
            return super().step(closure)

    Clipped.__name__ = Clipped.__qualname__ = f"Clipped{cls.__name__}"
    return Clipped


ClippedAdamW = clipped(torch.optim.AdamW)


def optimizer_class(spec: dict, steps: int) -> tuple[type, dict]:
    """The clipped optimizer class of ``spec["optimizer"]`` and its keyword arguments
    (without the LR); the peers' libraries are imported only when used."""
    name = spec.get("optimizer", "adamw")
    if name == "adamw":
        return ClippedAdamW, {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if name == "schedulefree":
        from schedulefree import AdamWScheduleFree
        return clipped(AdamWScheduleFree), {"betas": (0.9, 0.95), "weight_decay": 0.1,
                                            "warmup_steps": round(0.2 * steps)}
    if name == "prodigy":
        from prodigyopt import Prodigy
        return clipped(Prodigy), {"betas": (0.9, 0.95), "weight_decay": 0.1}
    raise ValueError(f"unknown optimizer {name!r}")


#: The LR of a spec without one: each library's recommended default.
DEFAULT_LR = {"schedulefree": 2.5e-3, "prodigy": 1.0}


@contextlib.contextmanager
def eval_iterates(optimizers):
    """Put the models' evaluation weights in place (schedule-free's averaged ``x``
    instead of the training point ``y``) for the body, with the library's ``eval_mode``
    where it has one; a no-op for optimizers without an eval mode."""
    try:
        from hdet_scale.iterates import eval_mode
    except ModuleNotFoundError as e:
        if e.name != "hdet_scale.iterates":
            raise
        eval_mode = _eval_mode
    with contextlib.ExitStack() as stack:
        for opt in optimizers:
            stack.enter_context(eval_mode(opt))
        yield


@contextlib.contextmanager
def _eval_mode(opt):
    if not hasattr(opt, "eval"):
        yield
        return
    opt.eval()
    try:
        yield
    finally:
        opt.train()


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
    from hdet_scale.train.model import ModelConfig, build_model, loss_fn, sequence_losses

    torch.set_num_threads(1)
    steps, seed = spec.get("steps", 200), spec["seed"]
    opt_name = spec.get("optimizer", "adamw")
    lr = spec["lr"] if "lr" in spec else DEFAULT_LR[opt_name]
    device = torch.device(spec.get("device", "cpu"))
    shards, probe, val = _data(seed)
    probe = [(x.to(device), y.to(device)) for x, y in probe]
    val = [(x.to(device), y.to(device)) for x, y in val]
    mcfg = ModelConfig(**MODEL_SIZES[spec.get("model_size", "default")], init_seed=seed,
                       dropout=spec.get("dropout", 0.0))
    opt_cls, opt_kw = optimizer_class(spec, steps)
    clip = spec.get("clip", 1.0)
    R = 1 if spec["kind"] == "plain" else REPLICAS
    if spec["kind"] == "plain":
        block = merge(BASE_HDET, {"replicas": 1, "axes": {"lr": {"spread_ratio": 0.0}},
                                  "auto": {"enabled": False}, "warm_init": {"enabled": False}})
    else:
        block = merge(BASE_HDET, spec.get("hdet", {}))
    if opt_name == "schedulefree":
        block["schedule"] = {"name": "constant"}  # it warms up itself and needs no decay
    block = merge(block, {"schedule": {"total_steps": steps}})
    block["sync_interval"] = min(block["sync_interval"], steps)

    # "probe_point": "average" scores each replica at the mean of its weights over the
    # last half of the interval instead of its last weights, "toward_mean" at
    # mean + probe_beta (w_r - mean), the replicas' mean being what converge takes next,
    # "between_xy" (schedule-free) at x + probe_alpha (y - x)
    # (prototypes: does either remove the short-horizon bias? docs/quality.md)
    averages: dict[int, list[torch.Tensor]] = {}
    counts: dict[int, int] = {}

    def probe_fn(model, r):
        point = spec.get("probe_point")
        if point == "toward_mean":
            beta = spec.get("probe_beta", 0.5)
            replicas = [list(m.parameters()) for m in sim.models]
            return _probe_at(model, [(mean := sum(p_.detach() for p_ in ps) / len(ps)) + beta * (p.detach() - mean)
                                     for p, ps in zip(model.parameters(), zip(*replicas))])
        if point == "between_xy":  # schedule-free: x + alpha (y - x), y = x + (1 - beta1) (z - x)
            alpha, opt = spec.get("probe_alpha", 0.5), sim.optimizers[r]
            beta1 = opt.param_groups[0]["betas"][0]
            return _probe_at(model, [p.detach() + alpha * (1 - beta1) * (opt.state[p]["z"] - p.detach())
                                     for p in model.parameters()])
        if point == "average" and counts.get(r):
            return _probe_at(model, [a / counts[r] for a in averages[r]])
        return _probe(model)

    @torch.no_grad()
    def _probe_at(model, weights):
        """The probe with ``model``'s parameters set to ``weights``, then put back."""
        saved = [p.clone() for p in model.parameters()]
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
        try:
            return _probe(model)
        finally:
            for p, s_ in zip(model.parameters(), saved):
                p.copy_(s_)

    def _probe(model):
        model.eval()
        if spec.get("probe_examples", True):  # per-sequence losses: auto-LR measures the gaps' noise
            loss = torch.cat([sequence_losses(model, x, y).double() for x, y in probe])
        else:  # the mean alone (the controller before hdet.auto.noise_scale)
            loss = sum(loss_fn(model, x, y) for x, y in probe) / len(probe)
        model.train()
        return loss

    def batch(r: int, step: int):
        if R == 1:  # plain: the 4 shards' sequences together
            parts = [s.batch(step) for s in shards]
            return torch.cat([p[0] for p in parts]).to(device), torch.cat([p[1] for p in parts]).to(device)
        x, y = shards[r].batch(step)
        return x.to(device), y.to(device)

    t0 = time.perf_counter()
    def optimizer(params):
        if not spec.get("two_groups"):
            opt = opt_cls(params, clip, lr=lr, **opt_kw)
        else:
            # Decay / no-decay groups, as most pretraining code builds them.
            kw = {k: v for k, v in opt_kw.items() if k != "weight_decay"}
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            opt = opt_cls(groups, clip, lr=lr, **kw)
        if hasattr(opt, "train"):
            opt.train()  # schedule-free refuses to step outside train mode
        return opt

    sim = Simulator(lambda: build_model(mcfg).to(device), optimizer, block,
                    probe_fn=probe_fn if spec["kind"] == "hdet" else None)
    if spec.get("hold_lr_max"):
        _hold_lr_max(sim)
    trace, diverged = [], False
    drop = spec.get("drop")  # {"at": step, "factor": f}: the LR times f from that step on
    for step in range(steps):
        if drop and step == drop["at"]:
            # An "oracle" LR change for plain runs: the same multiplier that auto-LR moves,
            # set by hand once (the schedule keeps its shape).
            sim.scheduler.controller.log_m[("lr", 0)] = math.log(drop["factor"])
            sim.scheduler._apply()
        T = block["sync_interval"]
        if spec.get("probe_point") == "average" and (step % T) == 0:
            averages.clear(), counts.clear()
        losses = sim.step(lambda model, r: loss_fn(model, *batch(r, step)))
        if spec.get("probe_point") == "average" and (step % T) + 1 >= T // 2 and (step + 1) % T:
            with torch.no_grad():
                for r, m in enumerate(sim.models):
                    acc = averages.setdefault(r, [torch.zeros_like(p) for p in m.parameters()])
                    for a, p in zip(acc, m.parameters()):
                        a.add_(p.detach())
                    counts[r] = counts.get(r, 0) + 1
        if not all(math.isfinite(float(x)) for x in losses):
            diverged = True
            break
        rec = sim.scheduler.last_sync
        if rec and rec.get("hdet/step") == step + 1:
            trace.append({"step": step + 1, "base": rec.get("hdet/lr/group_0/base"),
                          "multiplier": rec.get("hdet/lr/group_0/multiplier"),
                          "dropout": rec.get("hdet/dropout/group_0/base"),
                          "temperature": rec.get("hdet/temperature"), "noise": rec.get("hdet/fitness_noise"),
                          "hypergradient": rec.get("hdet/lr/group_0/hypergradient"),
                          "loss": sum(float(x) for x in losses) / len(losses)})
    if not diverged and sim.scheduler.converged_step != sim.scheduler.step_count:
        sim.converge()  # a run shorter than total_steps (the scheduler converges at its last step itself)
    wall = time.perf_counter() - t0
    if diverged:
        val_loss = float("nan")
    else:
        with eval_iterates(sim.optimizers):
            val_loss = _eval(sim.models[0], val)
    syncs = steps // block["sync_interval"]
    auto = block["auto"]
    probes = 0
    if spec["kind"] == "hdet" and auto.get("enabled") and auto.get("fitness", "probe") == "probe":
        first = max(math.ceil(auto.get("warmup_steps", 0) / block["sync_interval"]), 1)
        probes = max(syncs - first + 1, 0) * R * PROBE_BATCHES * MICRO
    passes = 3 * steps * REPLICAS * MICRO + probes
    return {**spec, "lr": lr, "val_loss": val_loss if math.isfinite(val_loss) else None,
            "diverged": diverged or not math.isfinite(val_loss), "passes": passes, "probe_passes": probes,
            "wall_s": wall, "trace": trace}


def _hold_lr_max(sim) -> None:
    """Prototype (docs/quality.md, 3000 steps): before every step, raise each replica's
    schedule-free ``lr_max`` to the spread's top LR times schedulefree's own warm-up factor,
    so every replica weights its z's into x alike and the spread changes z's step only."""
    apply = sim.scheduler._apply

    def held() -> None:
        apply()
        for g in range(len(sim.optimizers[0].param_groups)):
            top = max(o.param_groups[g]["lr"] for o in sim.optimizers)
            for o in sim.optimizers:
                grp = o.param_groups[g]
                k, warmup = grp["k"], grp["warmup_steps"]
                grp["lr_max"] = max(grp["lr_max"], top * ((k + 1) / warmup if k < warmup else 1.0))

    sim.scheduler._apply = held
    held()
