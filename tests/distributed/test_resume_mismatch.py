"""A resume whose checkpoint holds another model than the run builds, the settings
comparison before the start skipped.

``hdet-train`` refuses a changed ``model.*`` setting before any rank starts, from the
settings each save records in ``checkpoint/hdet_run_config.json``; when that file is lost
its refusal tells the user to write ``{"runs": {}}`` into it to resume without the
comparison. A user who then resumes with ``model.num_layers=2`` would get a raw
``RuntimeError: Error(s) in loading state_dict`` traceback from every rank and exit 1
(DDP, DeepSpeed), and FSDP2 would load the first 2 of the checkpoint's 4 layers without a
word and train on. Every rank compares the checkpoint's tensors (names and shapes,
read without their data) with its model before the engine's load and agrees on the
verdict: exit 2, one line naming the checkpoint folder, the differing tensors and the
likely cause, no traceback, the stopped run's records untouched.

A real run per backend (2 CPU ranks, a 29k-parameter model, 6 steps, checkpoints at 3
and 6; ``latest`` then set back to step 3, as a user resuming from an older complete
checkpoint does), then the resume with 2 layers.
"""

from __future__ import annotations

import json
import sys

import pytest
from cli_processes import run_cli

pytestmark = pytest.mark.timeout(600)

TRAIN = [sys.executable, "-m", "hdet_scale.train.cli"]
TINY = ["nproc=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
        "model.num_kv_heads=2", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=200000",
        "train.eval_batches=1", "train.probe_batches=1", "train.steps=6", "deepspeed.hdet.sync_interval=3",
        "deepspeed.hdet.auto.warmup_steps=2", "wandb.enabled=false", "train.progress=false", "train.plots=false"]
REFUSE_S = 60


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "deepspeed"])
def test_resume_of_another_model_without_the_settings_record_is_one_line(tmp_path, backend):
    run_dir = tmp_path / "run"
    rc, err, _, leftovers = run_cli([*TRAIN, f"run_dir={run_dir}", f"backend={backend}", "train.checkpoint_every=3",
                                     *TINY], timeout=300)
    assert rc == 0 and not leftovers, (rc, err[-3000:], leftovers)
    ckpt = run_dir / "checkpoint"
    (ckpt / "latest").write_text("global_step3")  # steps 4-6 left to train
    (ckpt / "hdet_run_config.json").write_text('{"runs": {}}')  # what the refusal of a lost record offers
    before = (run_dir / "metrics.jsonl").read_bytes()

    rc, err, seconds, leftovers = run_cli([*TRAIN, f"run_dir={run_dir}", f"backend={backend}", "train.resume=true",
                                           "model.num_layers=2", *TINY], timeout=REFUSE_S + 60)
    assert rc == 2, (rc, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("hdet-train: error:")]
    assert len(errors) == 1, err[-3000:]
    for words in (f"the checkpoint {ckpt}/replica_*/global_step3 holds another model than this run builds",
                  "18 in the checkpoint that this run's model lacks (model.layers.2.self_attn.q_proj.weight",
                  "model.* setting", f"{ckpt}/hdet_run_config.json holds no record of global_step3"):
        assert words in errors[0], (words, errors[0])
    assert seconds < REFUSE_S, seconds
    assert not leftovers, leftovers
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # the stopped run is left as it was


def test_the_comparison_names_shapes_and_leaves_unreadable_files_to_the_load(tmp_path):
    """Without processes: another width is named by the first tensors of another shape;
    a file this check cannot read as the backend's (an empty dict in DDP's place, a
    DeepSpeed folder without model states, no DCP metadata) or of another size than the
    folder's manifest records is no verdict (``None``): the load then names it, as before
    (``test_bad_inputs``: resume_model_file_replaced; ``test_signals``: a replaced file)."""
    import torch

    from hdet_scale.backends.checkpoint_shapes import saved_model_shapes
    from hdet_scale.backends.checkpoint_shapes import shape_difference as _shape_difference

    saved = {"model.embed_tokens.weight": (256, 32), "model.norm.weight": (32,)}
    built = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,)}
    assert _shape_difference(saved, built) == ("2 of another shape (model.embed_tokens.weight: checkpoint [256, 32], "
                                               "this run [256, 64], model.norm.weight: checkpoint [32], this run [64])")
    assert _shape_difference(saved, dict(saved)) is None
    torch.save({}, tmp_path / "model_optim.pt")
    assert saved_model_shapes("ddp", str(tmp_path)) is None
    assert saved_model_shapes("deepspeed", str(tmp_path)) is None
    assert saved_model_shapes("fsdp2", str(tmp_path)) is None
    torch.save({"model": {"w": torch.zeros(3, 2)}, "optimizer": {}}, tmp_path / "model_optim.pt")
    assert saved_model_shapes("ddp", str(tmp_path)) == {"w": (3, 2)}
    # a file of another size than the folder's manifest records: the load's manifest check names it
    size = (tmp_path / "model_optim.pt").stat().st_size
    (tmp_path / "hdet_manifest.json").write_text(json.dumps({"files": {"model_optim.pt": [size + 1, 0]}}))
    assert saved_model_shapes("ddp", str(tmp_path)) is None
    (tmp_path / "hdet_manifest.json").write_text(json.dumps({"files": {"model_optim.pt": [size, 0]}}))
    assert saved_model_shapes("ddp", str(tmp_path)) == {"w": (3, 2)}
