"""Puts tests/distributed and the repository root on ``sys.path`` whatever pytest's import
mode, so test modules can ``import harness`` (which re-exports ``benchmarks.ranks``, the one
launcher of tests and benchmarks) and spawned rank processes can import worker modules
(such as ``ds_workers``) by name: ``spawn`` children inherit the parent's ``sys.path``."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _path in (_ROOT, _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_runtest_setup(item):
    """A test module that starts no ranks of its own (the CLI tests: their launchers start
    ranks) runs with no pooled world idle beside it (``harness.run_ranks``)."""
    module = vars(item.module)
    if not any(name in module for name in ("harness", "rank_tools", "run_ranks", "run_fresh")):
        from benchmarks.ranks import close_pools

        close_pools()
