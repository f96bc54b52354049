"""Session set-up shared by all tests."""

from __future__ import annotations

import pytest


def _needs_deepspeed(items) -> bool:
    return any("distributed" in str(item.fspath) for item in items)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built(request):
    """Build DeepSpeed's CPU ops (shared-memory comm, fused Adam) once, in this process,
    before any rank starts: on a fresh machine the build takes minutes, and a rank killed
    by a test deadline mid-build would leave a stale lock that hangs every later start."""
    if not _needs_deepspeed(request.session.items):
        return
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":
        return
    import os

    from hdet_scale.backends.ds_cpuinfo import remember, share

    # py-cpuinfo asked once for the whole session, as hdet-train's launcher asks once for
    # its ranks: every rank and CLI process the tests start inherits the answer
    # (backends/ds_cpuinfo.py; 2.2 s of each DeepSpeed rank's start-up otherwise)
    os.environ.update(share())
    remember()
    names = ("ShareMemCommBuilder", "FusedAdamBuilder")
    # A fresh machine compiles both ops, one compiler process each (~45 s apiece on 2
    # cores): built side by side, one process per op (each op has its own folder and
    # lock), then loaded here from what they built. Never killed mid-build (a stale lock).
    import subprocess
    import sys

    builds = [subprocess.Popen([sys.executable, "-c", _BUILD.format(name=name)]) for name in names]
    for proc in builds:
        proc.wait()
    for name in names:
        builder = accel.create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load()


_BUILD = """
from deepspeed.accelerator import get_accelerator
from hdet_scale.backends.ds_cpuinfo import remember
remember()
builder = get_accelerator().create_op_builder("{name}")
if builder is not None and builder.is_compatible():
    builder.load()
"""
