"""``ds_machine.check_accelerator`` on ZeRO-Infinity's offload to NVMe (unchecked,
``offload_param.device: nvme`` would fail inside every rank with DeepSpeed's "Unable to JIT
load the async_io op" traceback after a minute, and ``nvme_path`` would never be checked).
The real accelerator and op builder of this machine: the async_io refusal is expected
exactly where DeepSpeed's own ``AsyncIOBuilder.is_compatible`` says no (libaio missing,
as on this CPU machine)."""

from __future__ import annotations

import pytest

from hdet_scale.backends.ds_machine import check_accelerator
from hdet_scale.errors import HDETConfigError


def _aio_ok() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False))


def _errors(zero: dict) -> list[str]:
    try:
        check_accelerator({"zero_optimization": {"stage": 3, **zero}})
    except HDETConfigError as e:
        return str(e).splitlines()[1:]
    return []


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_nvme_offload_needs_the_async_io_op_and_an_existing_folder(tmp_path, key):
    aio = [] if _aio_ok() else [f"zero_optimization.{key}.device: 'nvme' needs DeepSpeed's async_io op"]
    got = _errors({key: {"device": "nvme", "nvme_path": str(tmp_path)}})
    assert [e.strip()[:len(a)] for e, a in zip(got, aio)] == aio and len(got) == len(aio), got
    got = _errors({key: {"device": "nvme", "nvme_path": str(tmp_path / "missing")}})
    assert any(f"zero_optimization.{key}.nvme_path: '{tmp_path / 'missing'}' is not an existing folder" in e
               for e in got), got
    got = _errors({key: {"device": "nvme"}})
    assert any(f"zero_optimization.{key}.nvme_path: device 'nvme' needs the folder" in e for e in got), got
    file = tmp_path / "a_file"
    file.write_text("x")
    assert any("is not an existing folder" in e for e in _errors({key: {"device": "nvme", "nvme_path": str(file)}}))


@pytest.mark.parametrize("device", ["cpu", "none", None])
def test_other_offload_devices_are_not_asked_for_nvme(device):
    assert _errors({"offload_param": {"device": device, "nvme_path": "/no/such/folder"}}) == []


def test_both_offloads_to_nvme_name_each_key_once(tmp_path):
    got = _errors({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p")},
                   "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "o")}})
    assert sum("offload_param.nvme_path" in e for e in got) == 1 and sum("offload_optimizer.nvme_path" in e for e in got) == 1
    assert sum("async_io" in e for e in got) == (0 if _aio_ok() else 2), got


def test_fp16_is_refused_exactly_where_the_accelerator_has_none():
    from deepspeed.accelerator import get_accelerator

    try:
        check_accelerator({"fp16": {"enabled": True}})
        refused = None
    except HDETConfigError as e:
        refused = str(e)
    if get_accelerator().is_fp16_supported():
        assert refused is None, refused
    else:
        assert refused and "fp16.enabled: this machine's DeepSpeed accelerator" in refused, refused
    check_accelerator({"fp16": {"enabled": False}, "bf16": {"enabled": True}})
