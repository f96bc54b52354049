"""When DeepSpeed's MPI discovery is asked for (``backends.deepspeed.mpi_discovery_wanted``):
tester round 60 saw ``RANK``/``WORLD_SIZE``/``MASTER_*`` without ``LOCAL_RANK`` end in
DeepSpeed's ``import mpi4py`` traceback. The real join without ``LOCAL_RANK`` is
tests/distributed/test_deepspeed.py::test_a_world_without_local_rank_joins_over_env_without_mpi."""

from __future__ import annotations

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
