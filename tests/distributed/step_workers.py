"""Rank workers for tests/distributed/test_step_agreement.py: skipped steps keep every
rank at the same HDET step, and ranks out of step raise on every rank.

Spawned rank processes import this module by name (conftest.py puts tests/distributed on
``sys.path``). Every worker runs on 4 gloo ranks (2 replicas x 2 shards; ranks 0, 1
= replica 0) and returns plain Python / numpy data; the test process asserts.

A NaN gradient is made for real: at step ``NAN_STEP`` rank 0 multiplies its loss by NaN
before backward, so every gradient of rank 0 is NaN (the model's running-mean buffer,
updated in the forward from the inputs, stays finite). The loss handed to the scheduler
is that NaN on DeepSpeed (as from a non-finite forward) and the finite forward loss on
DDP (only the gradient is bad): both ways a skipped step can look. Each case runs twice on fresh engines from the same initial weights and
batches: once clean, once with the NaN.
"""

from __future__ import annotations

import copy
from typing import Any

import rank_tools
import torch
import torch.nn.functional as F
from rank_tools import LR, batch, build_model, hdet_block, lrs, rank

from hdet_scale.errors import HDETConfigError, HDETStateError

SYNC, STEPS, NAN_STEP = 3, 7, 4  # syncs at steps 3 and 6; the NaN in the second interval


def _hdet(sharing: str) -> dict:
    """Auto-LR off: the LR trace is the schedule's alone, so a NaN-free run must give the
    same one."""
    return hdet_block(gradient_sharing=sharing, sync_interval=SYNC)


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e)}


# ---- DeepSpeed ZeRO-3 -------------------------------------------------------------------

def _ds_run(sharing: str, nan: bool) -> dict:
    """STEPS optimizer steps of a 2 x 2 ZeRO-3 engine (partitioned parameters:
    persistence threshold 0). Per step: the LRs it ran with, whether DeepSpeed applied
    the update, the HDET step after it, the full fp32 masters after it (collective on the
    shard group), and what converge was about to average at each sync."""
    import ds_workers

    from hdet_scale.backends.deepspeed import initialize

    engine, opt, _, sched = initialize(build_model(), ds_workers.ds_config(_hdet(sharing), threshold=0))
    captured: list = []
    ds_workers.capture_converge(engine, sched, captured)
    out: dict[str, Any] = {"lrs": [], "applied": [], "hdet_step": [], "master": [], "nonfinite": {}}
    for step in range(1, STEPS + 1):
        out["lrs"].append(lrs(opt))
        x, y = batch(rank(), step)
        loss = F.mse_loss(engine(x), y)
        if nan and rank() == 0 and step == NAN_STEP:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step(lr_kwargs={"loss": loss.detach()})
        out["applied"].append(bool(engine.was_step_applied()))
        out["hdet_step"].append(sched.step_count)
        out["master"].append(ds_workers.full_master(engine))
        if step % SYNC == 0:
            out["nonfinite"][step] = sched.last_sync.get("hdet/nonfinite_replicas")
    out["captured"] = {c["step"]: c["master"] for c in captured}
    return out


def _ds_resumed_elsewhere() -> dict:
    """Rank 0 reloads its HDET state of step 3 after step 6 (as if it resumed from an
    older checkpoint than the others), then every rank trains 3 more steps: rank 0 reaches
    its sync at step 6, the others at step 9, in the same iteration."""
    import ds_workers

    from hdet_scale.backends.deepspeed import initialize

    engine, _, _, sched = initialize(build_model(), ds_workers.ds_config(_hdet("replica"), threshold=0))
    saved = None
    for step in range(1, 10):
        if step == 4:
            saved = copy.deepcopy(sched.state_dict())
        if step == 7 and rank() == 0:
            sched.load_state_dict(saved)
        try:
            ds_workers.train_step(engine, step)
        except HDETStateError as e:  # the check raises inside engine.step, at the sync
            return {"error": _error(e), "at_iteration": step, "hdet_step": sched.step_count}
    return {"error": None, "hdet_step": sched.step_count}


def ds_worker() -> dict:
    """Both gradient modes, clean and with the NaN, then the out-of-step case."""
    out = {f"{sharing}/{'nan' if nan else 'clean'}": _ds_run(sharing, nan)
           for sharing in ("global", "replica") for nan in (False, True)}
    out["resumed_elsewhere"] = _ds_resumed_elsewhere()
    return out


# ---- DDP with the torch backends' optimizer step ------------------------------------------
# ``optimizer_step`` is what hdet-train's TorchEngine.step calls (FSDP2, DDP, fairscale).

def _ddp(sharing: str, auto: dict | None = None, probe: Any = None):
    from hdet_scale.backends import ddp

    block = _hdet(sharing)
    if auto is not None:
        block["auto"] = auto
    return ddp.initialize(build_model(), block, lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.01),
                          probe=probe)


def _ddp_run(sharing: str, nan: bool, clip: float) -> dict:
    """As ``_ds_run``: forward, backward (DDP's all-reduce), ``optimizer_step``. Whether the
    update was applied: its return value, checked against AdamW's step count."""
    from hdet_scale.backends.torch_step import optimizer_step

    model, opt, sched = _ddp(sharing)
    module = model.module
    captured: list = []
    rank_tools.capture_converge(sched, captured, lambda: {"params": rank_tools.flat_numpy(module.parameters())})
    first = next(module.parameters())
    out: dict[str, Any] = {"lrs": [], "applied": [], "hdet_step": [], "master": [], "nonfinite": {}}
    for step in range(1, STEPS + 1):
        out["lrs"].append(lrs(opt))
        before = int(opt.state[first]["step"]) if first in opt.state else 0
        x, y = batch(rank(), step)
        loss = F.mse_loss(model(x), y)
        (loss * float("nan") if nan and rank() == 0 and step == NAN_STEP else loss).backward()
        applied = optimizer_step(model.parameters(), opt, sched, loss.detach(), clip)
        after = int(opt.state[first]["step"]) if first in opt.state else 0
        out["applied"].append(applied if after == before + int(applied) else "adam disagrees")
        out["hdet_step"].append(sched.step_count)
        out["master"].append(rank_tools.flat_numpy(module.parameters()))
        if step % SYNC == 0:
            out["nonfinite"][step] = sched.last_sync.get("hdet/nonfinite_replicas")
    out["captured"] = {c["step"]: c["params"] for c in captured}
    return out


def _ddp_extra_step() -> dict:
    """After one training step, rank 0 calls ``scheduler.step`` once more; then every rank
    syncs by hand (``scheduler.sync()``): rank 0 is at step 2, the others at step 1."""
    model, opt, sched = _ddp("replica")
    x, y = batch(rank(), 1)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step(loss.detach())
    if rank() == 0:
        sched.step(loss.detach())
    try:
        sched.sync()
    except HDETStateError as e:
        return {"error": _error(e), "hdet_step": sched.step_count}
    return {"error": None, "hdet_step": sched.step_count}


def _no_loss(fitness: str, loss_rank: int | None) -> dict:
    """Auto-LR on (warm-up 6: first meta-update at step 6), no training: every rank calls
    ``scheduler.step`` for SYNC steps, passing a loss only on ``loss_rank``. Returns the
    error of the first sync, if any, and the HDET step it came at."""
    auto = {"enabled": True, "warmup_steps": 6, "fitness": fitness}
    # The probe is never called: no meta-update before step 6.
    _, _, sched = _ddp("replica", auto, probe=(lambda model: torch.tensor(1.0)) if fitness == "probe" else None)
    try:
        for _ in range(SYNC):
            sched.step(2.0 if rank() == loss_rank else None)
    except HDETConfigError as e:
        return {"error": _error(e), "hdet_step": sched.step_count, "syncs": sched.sync_count}
    return {"error": None, "hdet_step": sched.step_count, "syncs": sched.sync_count}


def ddp_worker() -> dict:
    """Both gradient modes (clipping off in "global", at 0.05 in "replica": both paths),
    clean and with the NaN; the out-of-step case; auto-LR without a loss."""
    out: dict[str, Any] = {}
    for sharing, clip in (("global", 0.0), ("replica", 0.05)):
        for nan in (False, True):
            out[f"{sharing}/{'nan' if nan else 'clean'}"] = _ddp_run(sharing, nan, clip)
    out["extra_step"] = _ddp_extra_step()
    out["no_loss/train_loss"] = _no_loss("train_loss", None)
    out["no_loss/one_rank"] = _no_loss("train_loss", 3)
    out["no_loss/probe"] = _no_loss("probe", None)
    return out
