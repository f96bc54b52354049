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
    for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        builder = accel.create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load()
