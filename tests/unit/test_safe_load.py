"""Checkpoint files read without running code (``backends/safe_load.py``), in-process: each
kind of file a resume reads, crafted so that loading it creates a folder (the payload), is
refused naming the file and the reference, and the folder is never created; clean files of
the same kinds load. The per-engine refusal on real ranks, with the manifest updated to
match the crafted file, is ``tests/distributed/test_api.py``."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from hdet_scale.backends.safe_load import (dcp_metadata, folder_problem, load, refuse_untrusted_trainer_files,
                                           unsafe_problem)
from hdet_scale.errors import HDETStateError, HDETUntrustedFileError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process


class Payload:
    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return os.mkdir, (self.marker,)


def test_a_crafted_archive_is_refused_naming_the_file_and_the_reference(tmp_path):
    marker = tmp_path / "ran"
    for legacy in (False, True):  # torch.save's zip archive, and its older plain-pickle format
        path = tmp_path / f"hdet_shard_{int(legacy)}.pt"
        torch.save({"scheduler": Payload(marker)}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(HDETUntrustedFileError) as e:
            load(str(path))
        assert f"checkpoint file {path} holds a reference to posix.mkdir" in str(e.value)
        assert "nothing was loaded" in str(e.value) and isinstance(e.value, HDETStateError)
        assert unsafe_problem(str(path)) == str(e.value)
    # a plain pickle file (protocol 4 and the highest): torch refuses its first opcode
    # before any global, and the message still names the reference
    for protocol in (4, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"hdet_shard_p{protocol}.pt"
        with open(path, "wb") as f:
            pickle.dump({"scheduler": Payload(marker)}, f, protocol=protocol)
        problem = unsafe_problem(str(path))
        assert problem.startswith(f"checkpoint file {path} holds a reference to posix.mkdir"), problem
    assert not marker.exists()


def test_clean_files_load_as_saved(tmp_path):
    state = {"model": {"w": torch.randn(3, 4)}, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                                                            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
             "rng": {"cpu": torch.get_rng_state(), "cuda": None}, "optimizer_class": "AdamW"}
    torch.save(state, tmp_path / "model_optim.pt")
    got = load(str(tmp_path / "model_optim.pt"), mmap=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["optimizer"]["param_groups"] == \
        state["optimizer"]["param_groups"]
    (tmp_path / "hdet_manifest.json").write_text(json.dumps({"files": {}}))
    (tmp_path / "latest").write_text("global_step2")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "model_optim.pt").read_bytes()[:100])  # damage: not a refusal
    assert folder_problem(str(tmp_path)) is None


def _dcp_folder(tmp_path):
    folder = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.randn(8, 4)}, "step": 7, "param_groups": [{"lr": 0.1}]},
             checkpoint_id=str(folder), no_dist=True)
    return folder


def test_dcp_metadata_is_read_as_dcp_reads_it_and_a_crafted_one_is_refused(tmp_path):
    folder = _dcp_folder(tmp_path)
    assert dcp_metadata(str(folder)).state_dict_metadata == FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert folder_problem(str(folder)) is None
    marker = tmp_path / "ran"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(HDETUntrustedFileError, match=r"\.metadata holds a reference to posix\.mkdir"):
        dcp_metadata(str(folder))
    assert "posix.mkdir" in folder_problem(str(folder)) and not marker.exists()


def test_a_crafted_non_tensor_item_inside_a_distcp_file_is_refused(tmp_path):
    """DCP's planner loads non-tensor items with weights_only=False: one item replaced by
    the payload (appended to its .distcp file, .metadata pointing at it, itself clean)."""
    folder = _dcp_folder(tmp_path)
    meta = dcp_metadata(str(folder))
    fqn = "step"
    assert isinstance(meta.state_dict_metadata[fqn], BytesStorageMetadata)
    info = meta.storage_data[MetadataIndex(fqn)]
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    path = folder / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    meta.storage_data[MetadataIndex(fqn)] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    problem = unsafe_problem(str(folder / ".metadata"))
    assert problem.startswith(f"checkpoint file {path} (item 'step') holds a reference to posix.mkdir"), problem
    assert not marker.exists()


def test_trainer_files_with_numpy_rng_state_pass_and_a_crafted_one_is_refused(tmp_path):
    """Trainer's rng_state.pth holds numpy's RNG state (transformers allows its types);
    training_args.bin, which Trainer never reads back, is not read."""
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
               tmp_path / "rng_state_0.pth")
    torch.save({"last_epoch": 3, "_last_lr": [1e-3]}, tmp_path / "scheduler.pt")
    torch.save(Payload(tmp_path / "args_ran"), tmp_path / "training_args.bin")
    refuse_untrusted_trainer_files(str(tmp_path))
    torch.save({"python": Payload(tmp_path / "ran")}, tmp_path / "rng_state_1.pth")
    with pytest.raises(HDETUntrustedFileError, match=r"rng_state_1\.pth holds a reference to posix\.mkdir"):
        refuse_untrusted_trainer_files(str(tmp_path))
    assert not (tmp_path / "ran").exists() and not (tmp_path / "args_ran").exists()


@pytest.mark.parametrize("where", ["../outside.distcp", "absolute", "no path"])
def test_a_dcp_item_pointing_outside_its_folder_is_refused(tmp_path, where):
    """DCP joins an item's path to the folder as given: an absolute or "../" path would
    read another file on the machine as checkpoint data."""
    folder = _dcp_folder(tmp_path)
    meta = dcp_metadata(str(folder))
    index = MetadataIndex("step")
    outside = tmp_path / "outside.distcp"
    buf = io.BytesIO()
    torch.save(0.5, buf)
    outside.write_bytes(buf.getvalue())
    rel = str(outside) if where == "absolute" else where
    meta.storage_data[index] = "not storage info" if where == "no path" else dataclasses.replace(
        meta.storage_data[index], relative_path=rel, offset=0, length=len(buf.getvalue()))
    rel = "no file" if where == "no path" else rel
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    problem = folder_problem(str(folder))
    assert problem == (f"checkpoint file {folder / '.metadata'} points item 'step' at {rel}, outside the "
                       "checkpoint's folder, so nothing was loaded: a checkpoint reads only its own files. Resume "
                       "from a checkpoint you trust (written by hdet_scale, not changed since), or start a new "
                       "run_dir"), problem


def test_hdet_train_refuses_a_crafted_dcp_metadata_before_any_rank_starts(tmp_path):
    """The launcher's resume check (``train.validate``) names the file and the reference,
    and offers no settings to resume it with: no setting makes a crafted file loadable."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoint"
    for r in range(2):
        folder = ckpt / f"replica_{r}" / "global_step10"
        folder.mkdir(parents=True)
        for s in range(2):
            torch.save({"w": torch.zeros(4)}, folder / f"hdet_shard_{s}.pt")
    dcp.save({"model": {"w": torch.randn(8, 4)}}, checkpoint_id=str(ckpt / "replica_0/global_step10"), no_dist=True)
    marker = tmp_path / "ran"
    with open(ckpt / "replica_0/global_step10/.metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    (ckpt / "hdet_layout.json").write_text(json.dumps(
        {"world_size": 4, "replicas": 2, "shard_size": 2, "step": 10, "total_steps": 300, "backend": "fsdp2",
         "checkpoints": {"global_step10": 10}}))
    (ckpt / "latest").write_text("global_step10")
    (ckpt / "hdet_run_config.json").write_text('{"runs": {}}')
    (run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    run = load_run_config(None, ["backend=fsdp2", f"run_dir={run_dir}", "train.resume=true", "wandb.enabled=false",
                                 "deepspeed.hdet.replicas=2"])
    with pytest.raises(HDETUntrustedFileError) as e:
        validate(run, 4, build_model=False)
    assert str(e.value).startswith(f"checkpoint file {ckpt / 'replica_0/global_step10/.metadata'} holds a reference "
                                   "to posix.mkdir"), str(e.value)
    assert "to resume it" not in str(e.value) and not marker.exists()
