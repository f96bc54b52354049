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
