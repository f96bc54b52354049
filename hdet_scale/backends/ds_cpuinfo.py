"""The CPU's description, asked once per machine instead of twice per DeepSpeed rank.

DeepSpeed's op builder (``op_builder/builder.py``: ``cpu_arch`` and ``simd_width``) calls
py-cpuinfo's ``get_cpu_info()`` each time it loads a CPU op, and py-cpuinfo answers by
running a Python subprocess: 1.1 s a call here, two calls per rank, so 2.2 s of every
DeepSpeed rank's start-up on a CPU machine (measured with 2 ranks of ``hdet-train``: 4
calls, 4.4 s of a 9 s run). The answer is the machine's and cannot change while a job
runs: :func:`share` asks once in ``hdet-train``'s launcher and hands it to the ranks it
starts in ``HDET_CPU_INFO`` (JSON); :func:`remember`, called before DeepSpeed loads an op,
makes ``get_cpu_info`` answer from it (or from this process's first call). On a GPU
machine the CUDA builders do not ask for CPU ops; nothing changes there.
"""

from __future__ import annotations

import json
import os

#: The environment variable holding ``get_cpu_info()``'s answer as JSON.
ENV = "HDET_CPU_INFO"


def share() -> dict[str, str]:
    """``{ENV: json}`` for the environment of the ranks a launcher starts: this
    machine's ``get_cpu_info()`` (an inherited value is passed on as it is); ``{}`` when
    py-cpuinfo is missing or fails (each rank then asks DeepSpeed's way). Never raises."""
    if os.environ.get(ENV):
        return {ENV: os.environ[ENV]}
    try:
        import cpuinfo

        return {ENV: json.dumps(cpuinfo.get_cpu_info())}
    except Exception:  # noqa: BLE001 - only a start-up shortcut: DeepSpeed falls back itself
        return {}


def remember() -> None:
    """Make ``cpuinfo.get_cpu_info`` answer from ``HDET_CPU_INFO`` (when a launcher set
    it) or from its first answer in this process, a copy each time. DeepSpeed imports the
    function at each call (``from cpuinfo import get_cpu_info``), so it finds this one.
    Idempotent; never raises (a malformed value is ignored: asked once instead)."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "hdet_remembered", False):
        return
    asked = cpuinfo.get_cpu_info
    known: dict = {}
    try:
        given = json.loads(os.environ.get(ENV) or "null")
        if isinstance(given, dict) and "arch" in given:
            known.update(given)
    except ValueError:
        pass

    def get_cpu_info() -> dict:
        if not known:
            known.update(asked())
        return dict(known)

    get_cpu_info.hdet_remembered = True  # type: ignore[attr-defined]
    get_cpu_info.hdet_asked = asked  # type: ignore[attr-defined]  # py-cpuinfo's own, for tests
    cpuinfo.get_cpu_info = get_cpu_info
