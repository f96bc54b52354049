"""The stale-lock rule of ``hdet_scale/train/startup.py`` on real lock files: torch's own
``FileBaton`` holding one (a live build), and files left behind by nobody.

The end-to-end checks, a run that names a planted stale lock instead of hanging:
tests/distributed/test_bad_inputs.py (``stale_op_lock``: the launcher, before any rank
starts) and tests/distributed/test_startup.py (every rank, under torchrun).
"""

from __future__ import annotations

import os
import time

from torch.utils.file_baton import FileBaton

from hdet_scale.train import startup


def backdate(path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_a_lock_a_live_process_holds_is_never_stale_however_old(tmp_path):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    baton = FileBaton(str(lock))
    assert baton.try_acquire()  # what torch's loader does while it builds and imports an op
    try:
        backdate(lock, 3600)
        assert startup.lock_holders(str(lock)) == [os.getpid()]
        assert not startup.is_stale(str(lock))
        assert startup.stale_trainer_locks(str(tmp_path)) == []
    finally:
        baton.release()
    assert not lock.exists()


def test_a_lock_nobody_holds_is_stale_only_once_old_enough(tmp_path):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")  # left behind: created, its process gone
    assert startup.lock_holders(str(lock)) == []
    assert not startup.is_stale(str(lock))  # young: a holder may be between its close and its remove
    backdate(lock, startup.STALE_AFTER_S + 1)
    assert startup.is_stale(str(lock))
    assert startup.stale_trainer_locks(str(tmp_path)) == [str(lock)]
    message = startup.stale_lock_message(str(lock))
    assert f"rm {lock}" in message and "prebuilt" in message
    assert lock.exists()  # named, never removed


def test_extensions_dir_is_torch_extensions_dir_itself(tmp_path, monkeypatch):
    """TORCH_EXTENSIONS_DIR holds the op folders directly; the default adds a
    py<version>_<accelerator> level."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert startup.extensions_dir() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert os.path.basename(startup.extensions_dir()).startswith("py3")
