"""Puts tests/distributed on ``sys.path`` whatever pytest's import mode, so test modules can
``import harness`` and spawned rank processes can import worker modules (such as
``ds_workers``) by name: ``spawn`` children inherit the parent's ``sys.path``."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
