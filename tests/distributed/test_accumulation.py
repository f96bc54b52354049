"""Gradient accumulation in ``hdet-train`` on every backend, and activation checkpointing.

Per backend, one launch of 4 ranks (2 replicas x 2 shards) runs the real trainer
loop (``hdet_scale.train.loop.train``) several times, 10 optimizer steps each:

- ``k2``: accumulation 2 over micro-batches of 4;
- ``k1``: accumulation 1 over micro-batches of 8 (the same global batch);
- ``k2_ac``: ``k2`` with ``model.activation_checkpointing=true`` (deepspeed and fsdp2).

The loop draws one batch per optimizer step and splits it into the micro-batches, so
``k2`` and ``k1`` see the same sequences at every step and must compute the same
gradient up to float summation order. Adam with ``eps = 1`` and no clipping updates by
about ``lr x gradient`` (lr 0.5), so a gradient of the wrong scale shows in the next
step's loss and in the weights (plain Adam with clipping would normalise it away).
Auto-LR off, converge every 5 steps: every number compared is deterministic.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from accumulation_workers import train_runs
from harness import run_ranks

pytestmark = pytest.mark.timeout(600)

STEPS = 10
COMMON = ["deepspeed.optimizer.params.eps=1.0", "deepspeed.optimizer.params.lr=0.5", "deepspeed.gradient_clipping=0",
          f"train.steps={STEPS}", "deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.enabled=false",
          "train.eval_batches=4", "wandb.enabled=false", "train.progress=false", "train.checkpoint=false", "train.plots=false"]
RUNS = {"k2": ["deepspeed.train_micro_batch_size_per_gpu=4", "deepspeed.gradient_accumulation_steps=2"],
        "k1": ["deepspeed.train_micro_batch_size_per_gpu=8", "deepspeed.gradient_accumulation_steps=1"]}
RUNS["k2_ac"] = RUNS["k2"] + ["model.activation_checkpointing=true"]
WITH_AC = ("deepspeed", "fsdp2")


def launch(tmp_path, backend: str) -> dict:
    """Every run of ``backend`` in one 4-rank launch. Returns, per run name: the
    per-rank results of ``train_runs`` and the rank-0 step records of metrics.jsonl."""
    from hdet_scale.train.config import load_run_config

    names = [n for n in RUNS if n != "k2_ac" or backend in WITH_AC]
    runs = [load_run_config(None, [f"run_dir={tmp_path / name}", f"backend={backend}", *COMMON, *RUNS[name]])
            for name in names]
    per_rank = run_ranks(train_runs, 4, args=(runs,), timeout=540)
    out = {}
    for i, name in enumerate(names):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "hdet/loss" in r]
        out[name] = {"ranks": [r[i] for r in per_rank], "records": records,
                     "losses": [r["hdet/loss"] for r in records]}
    return out


def check_same_steps(a: dict, b: dict, loss_rel: float, weight_atol: float) -> None:
    """The two runs computed the same steps: per-step losses (rank 0's, each on the
    weights the earlier steps produced) within ``loss_rel``, final weights (after the last
    converge, gathered whole) within ``weight_atol`` (absolute, per element; the weights
    are O(0.01-1))."""
    assert len(a["losses"]) == len(b["losses"]) == STEPS
    assert a["losses"][0] == pytest.approx(b["losses"][0], rel=1e-6)  # same weights, same data
    assert a["losses"] == pytest.approx(b["losses"], rel=loss_rel)
    wa, wb = a["ranks"][0]["weights"], b["ranks"][0]["weights"]
    assert wa.shape == wb.shape
    diff = float(np.abs(wa - wb).max())
    assert diff <= weight_atol, f"final weights differ by up to {diff:.3g} (allowed {weight_atol:.3g})"


def check_counts(run: dict, k: int, backend: str, recomputed: bool = False) -> None:
    """k backward passes per optimizer step on every rank: counted by the engine (summary,
    metrics.jsonl) and by a hook on the model; each batch used once (tokens). Decoder
    layer 0 ran forward with gradients once per micro-batch, twice when ``recomputed``
    (activation checkpointing: the proof that it was on)."""
    seq_len = 128  # the packaged data.seq_len
    for r in run["ranks"]:
        s = r["summary"]
        assert s["steps"] == STEPS
        assert r["model_backward_passes"] == s["backward_passes"] == STEPS * k
        assert r["layer_forwards"] == STEPS * k * (2 if recomputed else 1)
        assert s["tokens_seen"] == STEPS * 8 * seq_len * 4  # the global batch, each sequence once
        if backend == "deepspeed":  # DeepSpeed's own counters: step() per micro-batch, one update per k
            assert (r["ds_global_steps"], r["ds_micro_steps"]) == (STEPS, STEPS * k)
    assert [x["train/backward_passes"] for x in run["records"]] == [k * (i + 1) for i in range(STEPS)]
    assert [x["train/tokens_seen"] for x in run["records"]] == [8 * seq_len * 4 * (i + 1) for i in range(STEPS)]


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2", "ddp", "fairscale"])
def test_accumulation_matches_one_big_micro_batch(tmp_path, backend):
    """Accumulation 2 x micro-batch 4 against 1 x 8 at the same global batch.

    Tolerances: the step-1 loss sees identical weights and data, so it differs only by
    the float32 summation order of the mean (rel 1e-6). Later steps add updates computed
    from gradients summed in another order (two halves vs one batch): per-step losses
    within rel 1e-5 and final weights within 1e-5 absolute (measured on all four
    backends: losses rel <= 1.9e-7, weights <= 1.7e-7, against |w| up to 0.82). With the
    1/k scaling dropped (a gradient k = 2 times too large; tried on all four backends)
    the losses part by up to rel 0.44 and the weights by 0.25. The backward passes
    (engine counter, model hook, metrics) equal steps x k on every rank: the old
    DeepSpeed loop (one ``engine.step()`` per k micro-batches) ran 40 instead of 20.

    With activation checkpointing (deepspeed, fsdp2) the same k = 2 run recomputes each
    layer's forward in the backward pass (layer 0 runs twice per micro-batch: it was on):
    the same operations on the same values (dropout 0); measured bit-identical, rel / abs
    1e-6 allowed for kernels whose summation order may vary elsewhere.
    """
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    if backend == "fairscale":
        pytest.importorskip("fairscale")
    runs = launch(tmp_path, backend)
    check_same_steps(runs["k2"], runs["k1"], loss_rel=1e-5, weight_atol=1e-5)
    check_counts(runs["k2"], 2, backend)
    check_counts(runs["k1"], 1, backend)
    assert runs["k1"]["losses"][-1] < runs["k1"]["losses"][0] - 0.1  # it trained
    if backend in WITH_AC:
        check_same_steps(runs["k2_ac"], runs["k2"], loss_rel=1e-6, weight_atol=1e-6)
        check_counts(runs["k2_ac"], 2, backend, recomputed=True)
