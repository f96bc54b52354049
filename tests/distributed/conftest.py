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
