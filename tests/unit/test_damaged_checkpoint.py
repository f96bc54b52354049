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


def _flip(path, start: int, count: int) -> None:
    """Invert ``count`` bytes from ``start``: the file keeps its size (the start-up check,
    ``damaged_files``, passes it), only its content is wrong."""
    data = bytearray(path.read_bytes())
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


class _FSDP2Engine:
    """What ``engines.py``'s engine does for ``backend=fsdp2`` on ``load``: the library's
    ``load_checkpoint`` (the trainer's engine also builds the data and model from a run config)."""

    def __init__(self, model, optimizer, scheduler):
        from hdet_scale.backends import fsdp2

        self.model, self.optimizer, self.scheduler, self._lib = model, optimizer, scheduler, fsdp2

    def load(self, path):
        self._lib.load_checkpoint(self.model, self.optimizer, self.scheduler, path)


def test_damaged_fsdp2_checkpoint_is_a_state_error_naming_the_file(tmp_path):
    """Issue 9 F3/F8: bytes flipped in a file of a real FSDP2 checkpoint (gloo, world 1),
    same size, so only the load can find it. DCP's ``CheckpointException`` (a BaseException
    wrapping the ``PytorchStreamReader`` error) and torch.load's own error on HDET's
    ``hdet_shard_0.pt`` both become one HDETStateError naming the damaged file; the intact
    checkpoint loads, and restores the saved weights exactly (same process, same dtype)."""
    import pytest
    import torch.distributed as dist

    from hdet_scale.backends import fsdp2
    from hdet_scale.errors import HDETStateError
    from hdet_scale.train import rundir

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = {"replicas": 1, "sync_interval": 2, "schedule": {"total_steps": 10}}
        model, opt, sched = fsdp2.initialize(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)),
                                             cfg, lambda p: torch.optim.AdamW(p, lr=1e-3))
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        sched.step()
        ckpt = tmp_path / "checkpoint"
        tag = fsdp2.save_checkpoint(model, opt, sched, str(ckpt))
        saved = [p.full_tensor().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        engine = _FSDP2Engine(model, opt, sched)
        rundir.load(engine, str(ckpt))
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(saved, model.parameters()))
        folder = ckpt / "replica_0" / tag
        assert rundir.damaged_file(str(folder)) is None
        for name in ("hdet_shard_0.pt", "__0_0.distcp"):
            victim = folder / name
            intact = victim.read_bytes()
            _flip(victim, 200, 200)  # the first archive's header records (measured: rc 1 before)
            assert damaged_files(str(folder)) == [], name  # the start-up check cannot see it
            with pytest.raises(HDETStateError) as err:
                rundir.load(engine, str(ckpt))
            assert f"could not load the checkpoint file {victim} (" in str(err.value), (name, str(err.value))
            victim.write_bytes(intact)
        rundir.load(engine, str(ckpt))
    finally:
        dist.destroy_process_group()
