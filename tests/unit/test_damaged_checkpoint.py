"""Checkpoint files cut short are found before a resume starts, by reading structure only
(``checkpoint_io.damaged_files``): a ``torch.save`` archive (DeepSpeed's model and
optimizer states, DDP's ``model_optim.pt``, HDET's ``hdet_shard_<s>.pt``) and a DCP
checkpoint (FSDP2's ``.distcp`` files and ``.metadata``), each written for real here and
then cut. Intact files pass the same check."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from hdet_scale.backends.checkpoint_io import damaged_files


def cut(path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def test_torch_save_archive_cut_anywhere_is_named(tmp_path):
    path = tmp_path / "model_optim.pt"
    torch.save({"model": {"w": torch.randn(300, 300)}, "optimizer": {"step": 3}}, path)
    assert damaged_files(str(tmp_path)) == []
    size = path.stat().st_size
    for keep in (size - 1, size - 30, size // 2, 10):
        torch.save({"model": {"w": torch.randn(300, 300)}, "optimizer": {"step": 3}}, path)
        cut(path, keep)
        problems = damaged_files(str(tmp_path))
        assert len(problems) == 1 and problems[0].startswith(f"{path}: truncated"), (keep, problems)
    cut(path, 0)
    assert damaged_files(str(tmp_path)) == [f"{path}: empty (0 bytes)"]


def test_dcp_checkpoint_cut_is_named(tmp_path):
    # "step" first: a .distcp file then starts with a torch.save archive, and must still not
    # be read as one archive (measured: its first bytes are "PK\x03\x04")
    state = {"step": 7, "model": {"w": torch.randn(256, 64), "b": torch.randn(64)}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    data = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert data and (tmp_path / data[0]).read_bytes()[:4] == b"PK\x03\x04"
    assert damaged_files(str(tmp_path)) == []
    victim = tmp_path / data[0]
    cut(victim, victim.stat().st_size - 100)
    problems = damaged_files(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: truncated"), problems
    cut(tmp_path / ".metadata", 20)
    problems = damaged_files(str(tmp_path))
    assert len(problems) == 1 and ".metadata: unreadable" in problems[0], problems
