"""``backends/ds_cpuinfo.py``: DeepSpeed's op builder reads the CPU description a launcher
shared (``HDET_CPU_INFO``) instead of running py-cpuinfo's subprocess twice per rank, and
builds with the same flags as when it asks itself."""

from __future__ import annotations

import json

import pytest

cpuinfo = pytest.importorskip("cpuinfo")
pytest.importorskip("deepspeed")

from hdet_scale.backends import ds_cpuinfo  # noqa: E402

# py-cpuinfo's own function, also when an earlier test of this process already called
# remember() (CI: a DeepSpeed engine built in-process): each test starts from it and the
# monkeypatch puts back whatever was there.
ASKED = getattr(cpuinfo.get_cpu_info, "hdet_asked", cpuinfo.get_cpu_info)


def _flags() -> tuple[str, str]:
    from deepspeed.ops.op_builder.builder import OpBuilder

    class Probe(OpBuilder):  # the base class's own cpu_arch / simd_width
        def __init__(self):
            super().__init__("probe")

        def absolute_name(self):
            return "probe"

        def sources(self):
            return []

    probe = Probe()
    return probe.cpu_arch(), probe.simd_width()


def test_the_shared_answer_gives_deepspeed_the_flags_it_finds_itself(monkeypatch):
    monkeypatch.setattr(cpuinfo, "get_cpu_info", ASKED)  # restored after the test
    monkeypatch.delenv(ds_cpuinfo.ENV, raising=False)
    asked = _flags()  # DeepSpeed asking py-cpuinfo itself
    shared = ds_cpuinfo.share()
    assert json.loads(shared[ds_cpuinfo.ENV])["arch"] == cpuinfo.get_cpu_info()["arch"]
    monkeypatch.setenv(ds_cpuinfo.ENV, shared[ds_cpuinfo.ENV])
    ds_cpuinfo.remember()
    assert getattr(cpuinfo.get_cpu_info, "hdet_remembered", False)
    assert _flags() == asked
    ds_cpuinfo.remember()  # idempotent: not wrapped twice
    assert cpuinfo.get_cpu_info() == json.loads(shared[ds_cpuinfo.ENV])
    assert ds_cpuinfo.share() == shared  # passed on as inherited


def test_the_builder_reads_the_shared_answer_not_a_new_one(monkeypatch):
    """A description of another machine in ``HDET_CPU_INFO`` (a PowerPC) changes
    DeepSpeed's flag: proof that it reads the shared answer and asks nothing itself."""
    monkeypatch.setattr(cpuinfo, "get_cpu_info", ASKED)
    monkeypatch.setenv(ds_cpuinfo.ENV, json.dumps({"arch": "PPC_64", "flags": []}))
    ds_cpuinfo.remember()
    assert _flags()[0] == "-mcpu=native"


def test_a_malformed_value_is_ignored(monkeypatch):
    monkeypatch.setattr(cpuinfo, "get_cpu_info", ASKED)
    real = cpuinfo.get_cpu_info()["arch"]
    monkeypatch.setenv(ds_cpuinfo.ENV, "{not json")
    ds_cpuinfo.remember()
    assert cpuinfo.get_cpu_info()["arch"] == real
