"""The refusal marker torchrun's restarts read (``train/refusals.py``): written only when
a restart can follow, and removed by ``forget_agent`` for the agent that ends (the
launchers' torchrun restarts no refusal: tests/distributed/test_bad_inputs.py)."""

from __future__ import annotations

import os

from hdet_scale.train import refusals


def _attempt(monkeypatch, tmp_path, restart: int, max_restarts: int) -> None:
    monkeypatch.setattr(refusals.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv(refusals.RESTART_VAR, str(restart))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")


def test_a_refusal_is_remembered_only_when_a_restart_can_read_it(monkeypatch, tmp_path):
    argv = ["train.steps=ten"]
    _attempt(monkeypatch, tmp_path, 0, 0)  # --max-restarts=0: no restart reads it
    refusals.remember(argv, "no")
    assert not os.path.isdir(refusals._folder()) or os.listdir(refusals._folder()) == []
    _attempt(monkeypatch, tmp_path, 0, 2)
    refusals.remember(argv, "train.steps: not an integer")
    assert len(os.listdir(refusals._folder())) == 1
    _attempt(monkeypatch, tmp_path, 1, 2)
    assert refusals.remembered(argv) == "train.steps: not an integer"
    assert refusals.remembered(["train.steps=10"]) is None  # another command: checked afresh


def test_forget_agent_removes_only_that_agents_markers(monkeypatch, tmp_path):
    _attempt(monkeypatch, tmp_path, 0, 3)
    refusals.remember(["a=1"], "one")
    refusals.remember(["a=2"], "two")
    other = os.path.join(refusals._folder(), f"{os.getppid() + 1}-0123")  # another job's agent
    open(other, "w").close()
    refusals.forget_agent(os.getppid())  # the ranks' parent: the agent
    assert os.listdir(refusals._folder()) == [os.path.basename(other)]
    refusals.forget_agent(12345678)  # none of its own: nothing happens, nothing raises
    assert os.path.exists(other)
