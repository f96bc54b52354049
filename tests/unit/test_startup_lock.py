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


def _advice(message: str) -> str:
    """The command in the message's "Delete it (<command>)"."""
    return message.split("Delete it (", 1)[1].split(")", 1)[0]


def test_the_advice_clears_whatever_blocks_the_loader(tmp_path):
    """Anything at the lock's name blocks torch's loader (its O_CREAT | O_EXCL open fails):
    an empty or non-empty folder, a dangling symbolic link, a file. For each, the message
    names what is there and its command, run in a shell, clears it, after which torch's
    own FileBaton acquires the lock. Before the fix a folder got ``rm <lock>`` (rm refuses
    a folder) and a dangling link, aged by stat through the link, was never called stale."""
    import subprocess

    def folder(lock):
        lock.mkdir()

    def full_folder(lock):
        lock.mkdir()
        (lock / "junk").write_text("x")

    def dangling(lock):
        lock.symlink_to(tmp_path / "nowhere")

    def plain(lock):
        lock.write_text("")

    for make, kind, command in ((folder, "a folder", "rmdir"), (full_folder, "a folder", "rm -r"),
                                (dangling, "a symbolic link", "rm"), (plain, None, "rm")):
        lock = tmp_path / make.__name__ / "fused_adam" / "lock"
        lock.parent.mkdir(parents=True)
        make(lock)
        assert not FileBaton(str(lock)).try_acquire()  # the loader would wait on it forever
        os.utime(lock, (time.time() - 3600,) * 2, follow_symlinks=False)
        assert startup.stale_trainer_locks(str(lock.parent.parent)) == [str(lock)], make.__name__
        message = startup.stale_lock_message(str(lock))
        assert (kind is None and "a folder" not in message and "link" not in message) or kind in message, message
        advice = _advice(message)
        assert advice == f"{command} {lock}", (make.__name__, advice)
        subprocess.run(advice, shell=True, check=True)
        assert not os.path.lexists(lock)
        baton = FileBaton(str(lock))
        assert baton.try_acquire()
        baton.release()
