"""How a rank's start-up error tells an op build that ended without its op (``op_missing``)
from a real defect, on torch's own JIT loader: the waiting side of a Ctrl-C during a first
``fused_adam`` compile. The building side (``build_interrupted``)
is tested in test_startup_lock.py.
"""

from __future__ import annotations

import threading

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from hdet_scale.backends.op_builds import op_missing


@pytest.fixture
def op_folder(tmp_path, monkeypatch):
    """An extensions folder with one op folder and the op's source (never compiled here)."""
    ext = tmp_path / "ext"
    (ext / "hdet_test_op").mkdir(parents=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    src = tmp_path / "op.cpp"
    src.write_text("int hdet_test_op() { return 1; }\n")
    return ext / "hdet_test_op", src


def test_a_waited_on_build_that_ended_without_the_op_is_named(op_folder):
    """Another process holds the op's lock (its build), this one waits in torch's loader,
    and the lock goes away with no library written (the builder stopped by a Ctrl-C): the
    loader's ImportError is recognised and names the op, not printed as a traceback that
    the launcher calls a failure."""
    folder, src = op_folder
    baton = FileBaton(str(folder / "lock"))
    assert baton.try_acquire()  # the other process's build
    threading.Timer(1.0, baton.release).start()  # ... stopped: lock removed, no .so
    with pytest.raises(ImportError) as info:
        cpp_extension.load(name="hdet_test_op", sources=[str(src)])
    assert not (folder / "hdet_test_op.so").exists()
    assert op_missing(info.value) == "hdet_test_op"
    # raised from inside the engine build, as DeepSpeed's loader may wrap it
    try:
        try:
            raise info.value
        except ImportError as inner:
            raise RuntimeError("engine build failed") from inner
    except RuntimeError as outer:
        assert op_missing(outer) == "hdet_test_op"


def test_a_library_that_exists_but_does_not_load_is_a_real_error(op_folder):
    """A broken library is a defect the user must see in full: not recognised."""
    folder, _ = op_folder
    (folder / "hdet_test_op.so").write_bytes(b"not an ELF file")
    with pytest.raises(ImportError) as info:
        cpp_extension._import_module_from_library("hdet_test_op", str(folder), True)
    assert op_missing(info.value) is None


def test_a_missing_library_while_the_lock_is_held_is_not_an_ended_build(op_folder):
    """A lock still there is a build under way (or a stale lock, which startup.py names):
    not an ended build."""
    folder, _ = op_folder
    (folder / "lock").write_text("")
    with pytest.raises(ImportError) as info:
        cpp_extension._import_module_from_library("hdet_test_op", str(folder), True)
    assert op_missing(info.value) is None
    assert op_missing(ImportError("No module named 'wandb'")) is None
    assert op_missing(RuntimeError("Connection reset by peer")) is None


def test_the_launcher_names_both_ends_of_a_stopped_build_without_a_traceback():
    """With no stop signal of its own (a background job's launcher ignores SIGINT, while
    ninja, in the same process group, does not), the launcher's failure line says what
    each rank met, not bare exit codes."""
    from hdet_scale.train.rank_failures import BUILD_STOPPED, OP_MISSING, describe_failures

    line = describe_failures({0: OP_MISSING, 1: BUILD_STOPPED})
    assert line == ("failed: rank(s) [1] had its DeepSpeed op build (ninja) stopped by a signal, rank(s) [0] found "
                    "no DeepSpeed op after waiting on another rank's build of it (that build was stopped or failed)"), line
