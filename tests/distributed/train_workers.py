"""Rank workers for tests/distributed/test_train.py: the trainer's CLI run as one rank of a
world started by the test (as torchrun would), returning its exit code."""

from __future__ import annotations

import contextlib
import io


def cli_rank(argv: list[str]) -> dict:
    from hdet_scale.train.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return {"code": code, "stderr": err.getvalue()}
