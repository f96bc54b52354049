"""When DeepSpeed's MPI discovery is asked for (``backends.deepspeed.mpi_discovery_wanted``):
not for ``RANK``/``WORLD_SIZE``/``MASTER_*`` without ``LOCAL_RANK``, which would end in
DeepSpeed's ``import mpi4py`` traceback. The real join without ``LOCAL_RANK`` is
tests/distributed/test_deepspeed.py::test_a_world_without_local_rank_joins_over_env_without_mpi."""

from __future__ import annotations

import os

import pytest

from hdet_scale.backends.deepspeed import mpi_discovery_wanted

ENV_WORLD = {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ALL_VARS = (*ENV_WORLD, "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ALL_VARS:
        monkeypatch.delenv(k, raising=False)


def test_a_complete_env_world_without_local_rank_does_not_look_for_mpi(monkeypatch):
    for k, v in ENV_WORLD.items():
        monkeypatch.setenv(k, v)
    assert mpi_discovery_wanted() is False
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's full set: DeepSpeed skips discovery itself
    assert mpi_discovery_wanted() is False


@pytest.mark.parametrize("missing", sorted(ENV_WORLD))
def test_an_incomplete_env_world_keeps_deepspeeds_discovery(monkeypatch, missing):
    for k, v in ENV_WORLD.items():
        if k != missing:
            monkeypatch.setenv(k, v)
    assert mpi_discovery_wanted() is True


@pytest.mark.parametrize("mark", ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"])
def test_an_mpi_launcher_keeps_deepspeeds_discovery(monkeypatch, mark):
    for k, v in ENV_WORLD.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(mark, "1")
    assert mpi_discovery_wanted() is True


def test_an_accelerator_without_local_rank_is_refused_before_any_collective(monkeypatch):
    """On an accelerator, no LOCAL_RANK is asked for, not guessed (two ranks could share a
    device). No GPU here: DeepSpeed's accelerator is stood in for by one that names
    "cuda", and the refusal must come before torch.distributed is touched."""
    import deepspeed.accelerator
    import torch.distributed as dist

    from hdet_scale.backends import deepspeed as ds_backend
    from hdet_scale.errors import HDETConfigError

    class Cuda:
        def device_name(self, index=None):
            return "cuda"

    for k, v in ENV_WORLD.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Cuda())
    with pytest.raises(HDETConfigError, match="LOCAL_RANK is not set, and DeepSpeed needs it"):
        ds_backend._init_distributed(None)
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ
