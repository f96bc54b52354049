"""Checkpoint files cut short are found before a resume starts, by reading structure only
(``checkpoint_io.damaged_files``): a ``torch.save`` archive (DeepSpeed's model and
optimizer states, DDP's ``model_optim.pt``, HDET's ``hdet_shard_<s>.pt``) and a DCP
checkpoint (FSDP2's ``.distcp`` files and ``.metadata``), each written for real here and
then cut. Intact files pass the same check."""

from __future__ import annotations

import json
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


def _tensor_bytes(path) -> int:
    """The file offset of the largest tensor's bytes in a ``torch.save`` archive (stored,
    not compressed: the member's data follows its 30-byte local header, name and extra)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def _world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)


class _Engine:
    """What ``engines.py``'s engine does on ``load``: the backend library's
    ``load_checkpoint`` (the trainer's engine also builds the data and model from a run config)."""

    def __init__(self, lib, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler, self._lib = model, optimizer, scheduler, lib

    def load(self, path):
        self._lib.load_checkpoint(self.model, self.optimizer, self.scheduler, path)


def _trained(lib, tmp_path):
    torch.manual_seed(0)
    cfg = {"replicas": 1, "sync_interval": 2, "schedule": {"total_steps": 10}}
    model, opt, sched = lib.initialize(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)),
                                       cfg, lambda p: torch.optim.AdamW(p, lr=1e-3))
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    sched.step()
    return _Engine(lib, model, opt, sched)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def test_damaged_fsdp2_checkpoint_is_a_state_error_naming_the_file(tmp_path):
    """Bytes flipped in a file of a real FSDP2 checkpoint (gloo, world 1), same size, so the
    start-up check (``damaged_files``) cannot see it. Both a header region (the load would
    fail: DCP's ``CheckpointException``, torch.load's error) and a tensor's bytes (the load
    would succeed with wrong values) are found by the CRC check every load runs first
    (``checkpoint_io.verify_checksums``): one HDETStateError naming the file. The intact
    checkpoint loads, restoring the saved weights exactly."""
    import pytest
    import torch.distributed as dist

    from hdet_scale.backends import fsdp2
    from hdet_scale.errors import HDETStateError
    from hdet_scale.train import run_checkpoint

    _world_of_one(tmp_path)
    try:
        engine = _trained(fsdp2, tmp_path)
        ckpt = tmp_path / "checkpoint"
        tag = fsdp2.save_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        saved = [p.full_tensor().clone() for p in engine.model.parameters()]
        with torch.no_grad():
            for p in engine.model.parameters():
                p.zero_()
        run_checkpoint.load(engine, str(ckpt))
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(saved, engine.model.parameters()))
        folder = ckpt / "replica_0" / tag
        for name, where in (("hdet_shard_0.pt", 200), ("__0_0.distcp", 200), ("__0_0.distcp", "middle")):
            victim = folder / name
            intact = victim.read_bytes()
            start = len(intact) // 2 if where == "middle" else where
            _flip(victim, start, 64)
            assert damaged_files(str(folder)) == [], name  # the start-up check cannot see it
            with pytest.raises(HDETStateError) as err:
                run_checkpoint.load(engine, str(ckpt))
            assert f"has a damaged file: {victim} (" in str(err.value), (name, str(err.value))
            assert "weights_only" not in str(err.value)
            victim.write_bytes(intact)
        run_checkpoint.load(engine, str(ckpt))
    finally:
        dist.destroy_process_group()


def test_tensor_bytes_changed_in_place_are_refused_not_loaded(tmp_path):
    """The silent case: a DDP ``model_optim.pt`` whose weight bytes are overwritten (same
    size) would load without complaint and train on NaN. Shown first: torch itself reads
    the damaged file, with weights that differ from the saved ones, so nothing but the CRC
    check stands in the way. Then ``ddp.load_checkpoint`` refuses it, naming the file and
    the member, and leaves the model as it was."""
    import pytest
    import torch.distributed as dist

    from hdet_scale.backends import ddp
    from hdet_scale.errors import HDETStateError

    _world_of_one(tmp_path)
    try:
        engine = _trained(ddp, tmp_path)
        ckpt = tmp_path / "checkpoint"
        tag = ddp.save_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        victim = ckpt / "replica_0" / tag / "model_optim.pt"
        before = {k: v.clone() for k, v in torch.load(victim, weights_only=False)["model"].items()}
        _flip(victim, _tensor_bytes(victim) + 8, 8)
        after = torch.load(victim, weights_only=False)["model"]  # torch reads it: no error
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert damaged_files(str(victim.parent)) == []
        now = [_full(p).clone() for p in engine.model.parameters()]
        with pytest.raises(HDETStateError) as err:
            ddp.load_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        assert f"has a damaged file: {victim} (member " in str(err.value) and "CRC" in str(err.value), str(err.value)
        assert all(torch.equal(a, _full(p)) for a, p in zip(now, engine.model.parameters()))
    finally:
        dist.destroy_process_group()


def test_a_file_put_in_another_files_place_is_refused_by_the_manifest(tmp_path):
    """A complete, undamaged file of the same run in another file's place (here
    ``model_optim.pt`` copied from the step-1 checkpoint into the step-2 one, as a user
    restoring "a copy" might) passes every archive check and loads: shown first, torch reads
    it, with the step-1 weights. The manifest each save writes (``backends/manifest.py``:
    sizes and CRC-32s) makes the load refuse it, naming the file. A folder without a
    manifest (an older save) falls back to the archives' own CRCs, so the same copy then
    loads (the limit the manifest removes); a save that wrote a manifest and lost it is
    refused."""
    import shutil

    import pytest
    import torch.distributed as dist

    from hdet_scale.backends import ddp
    from hdet_scale.backends.manifest import MANIFEST_FILE
    from hdet_scale.errors import HDETStateError

    _world_of_one(tmp_path)
    try:
        engine = _trained(ddp, tmp_path)
        ckpt = tmp_path / "checkpoint"
        first = ddp.save_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        engine.model(torch.randn(8, 32)).square().mean().backward()
        engine.optimizer.step()
        engine.scheduler.step()
        second = ddp.save_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        assert first != second and (ckpt / "replica_0" / second / MANIFEST_FILE).is_file()
        ddp.load_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))  # intact: loads
        victim = ckpt / "replica_0" / second / "model_optim.pt"
        shutil.copyfile(ckpt / "replica_0" / first / "model_optim.pt", victim)
        stale = torch.load(victim, weights_only=False)["model"]
        assert any(not torch.equal(v, _full(p)) for v, p in zip(stale.values(), engine.model.parameters()))
        with pytest.raises(HDETStateError) as err:
            ddp.load_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        assert f"{victim} (not the file this checkpoint saved there" in str(err.value), str(err.value)
        # the manifest deleted: the layout records that this save wrote
        # one, so its loss is refused before any load, not a fall back to the weaker check
        (ckpt / "replica_0" / second / MANIFEST_FILE).unlink()
        with pytest.raises(HDETStateError) as err:
            ddp.load_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
        assert f"{MANIFEST_FILE} (missing: this checkpoint was saved with one" in str(err.value), str(err.value)
        # a layout that lists no manifests (saved by hdet_scale <= 0.3): the archives' CRCs
        # alone, with a warning, so the same copy then loads (the limit the manifest removes)
        layout_path = ckpt / "hdet_layout.json"
        layout = json.loads(layout_path.read_text())
        layout_path.write_text(json.dumps({k: v for k, v in layout.items() if k != "manifests"}))
        with pytest.warns(UserWarning, match="saved without file manifests"):
            ddp.load_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
    finally:
        dist.destroy_process_group()


def test_the_pre_start_listing_check_finds_missing_resized_and_unreadable(tmp_path):
    """``manifest.listing_problem`` (run before any rank starts, by ``stat`` alone): a
    file the manifest lists that is gone or of another size, an unreadable manifest, and
    a missing one only when the save wrote one."""
    from hdet_scale.backends.manifest import MANIFEST_FILE, digest, listing_problem

    (tmp_path / "a.pt").write_bytes(b"x" * 10)
    assert listing_problem(str(tmp_path), required=False) is None
    assert "missing: this checkpoint was saved with one" in listing_problem(str(tmp_path), required=True)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"files": {"a.pt": digest(str(tmp_path / "a.pt"))}}))
    assert listing_problem(str(tmp_path), required=True) is None
    (tmp_path / "a.pt").write_bytes(b"x" * 11)
    assert "a.pt (not the file this checkpoint saved there: 11 bytes; the save recorded 10" in \
        listing_problem(str(tmp_path), required=True)
    (tmp_path / "a.pt").unlink()
    assert "a.pt (missing: hdet_manifest.json lists it)" in listing_problem(str(tmp_path), required=True)
    (tmp_path / MANIFEST_FILE).write_text("{")
    assert "(unreadable: JSONDecodeError" in listing_problem(str(tmp_path), required=False)


def test_an_index_whose_step_disagrees_with_its_tag_is_damaged(tmp_path):
    """hdet_layout.json edited to list global_step10 at step 15 would resume with "the
    state after optimizer step 15" while the engine restores step 10: a default tag
    names its step, so an index that disagrees is refused as damaged; one that agrees,
    or a user's own tag, reads as usual."""
    import pytest

    from hdet_scale.backends.checkpoints import read_layout
    from hdet_scale.errors import HDETStateError

    layout = {"world_size": 2, "replicas": 2, "shard_size": 1, "step": 10, "checkpoints": {"global_step10": 15}}
    (tmp_path / "hdet_layout.json").write_text(json.dumps(layout))
    (tmp_path / "latest").write_text("global_step10")
    with pytest.raises(HDETStateError, match=r"hdet_layout.json is damaged: it lists global_step10 \(saved after "
                                             r"optimizer step 10\) at step 15: restore it from a copy"):
        read_layout(str(tmp_path))
    layout["checkpoints"] = {"global_step10": 10}
    (tmp_path / "hdet_layout.json").write_text(json.dumps(layout))
    assert read_layout(str(tmp_path))["step"] == 10
    layout["checkpoints"] = {"best": 15}
    (tmp_path / "hdet_layout.json").write_text(json.dumps(layout))
    (tmp_path / "latest").write_text("best")
    assert read_layout(str(tmp_path))["step"] == 15


def _saved_and_another(lib, tmp_path, width: int, make_optimizer):
    """A trained run of ``lib`` (``_trained``: Linear(32, 32) + Linear(32, 4), AdamW) and
    its checkpoint, then a new ``initialize`` of Linear(32, width) + Linear(width, 4) with
    ``make_optimizer``: ``(engine, checkpoint folder, (model, optimizer, scheduler))``."""
    engine = _trained(lib, tmp_path)
    ckpt = tmp_path / f"checkpoint_{lib.__name__.rsplit('.', 1)[1]}"
    lib.save_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))
    torch.manual_seed(1)
    cfg = {"replicas": 1, "sync_interval": 2, "schedule": {"total_steps": 10}}
    module = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Linear(width, 4))
    return engine, ckpt, lib.initialize(module, cfg, make_optimizer)


def test_a_checkpoint_of_another_optimizer_class_is_refused_before_anything_loads(tmp_path):
    """An AdamW checkpoint loaded into an SGD run (the library's DDP and FSDP2 backends,
    gloo world 1) would load, and the first step raise ``KeyError: 'momentum'``. Shown
    first: torch's own load_state_dict takes AdamW's state into SGD without a word.
    ``load_checkpoint`` raises HDETStateError naming both classes and leaves the model's
    weights as they were (compared exactly); the same optimizer class loads."""
    import pytest
    import torch.distributed as dist

    from hdet_scale.backends import ddp, fsdp2
    from hdet_scale.errors import HDETStateError

    _world_of_one(tmp_path)
    try:
        for lib in (ddp, fsdp2):
            engine, ckpt, (model, sgd, sched) = _saved_and_another(
                lib, tmp_path, 32, lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9))
            probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
            probe.load_state_dict({"state": {}, "param_groups": [
                {**engine.optimizer.state_dict()["param_groups"][0], "params": [0]}]})  # torch: no error
            assert "momentum" not in probe.param_groups[0]
            before = [_full(p).clone() for p in model.parameters()]
            with pytest.raises(HDETStateError) as err:
                lib.load_checkpoint(model, sgd, sched, str(ckpt))
            assert "saved from torch AdamW, and this run's optimizer is SGD" in str(err.value), str(err.value)
            assert all(torch.equal(a, _full(p)) for a, p in zip(before, model.parameters()))
            assert sched.step_count == 0
            lib.load_checkpoint(engine.model, engine.optimizer, engine.scheduler, str(ckpt))  # same class: loads
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_of_another_model_is_refused_by_the_librarys_ddp_and_fairscale_loads(tmp_path):
    """Every backend's load refuses a checkpoint of another width first (hdet-train and
    FSDP2 by name; the library's DDP load would be torch's "Error(s) in loading
    state_dict" traceback on every rank): HDETStateError naming the tensors and both
    shapes; the model is left as it was (compared exactly)."""
    import pytest
    import torch.distributed as dist

    from hdet_scale.backends import ddp, fairscale
    from hdet_scale.errors import HDETStateError

    _world_of_one(tmp_path)
    try:
        for lib in (ddp, fairscale):
            _, ckpt, (model, opt, sched) = _saved_and_another(lib, tmp_path, 16,
                                                              lambda p: torch.optim.AdamW(p, lr=1e-3))
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(HDETStateError) as err:
                lib.load_checkpoint(model, opt, sched, str(ckpt))
            assert "holds another model than the one loading it: 3 of another shape (0.weight: checkpoint " \
                   "[32, 32], this run [16, 32]" in str(err.value), str(err.value)
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        dist.destroy_process_group()
