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


def test_the_agents_failure_note_names_the_failure_in_rank_0s_line(monkeypatch, tmp_path):
    """Rank 0, ended by the agent after another rank was killed, does not say "stopped by
    SIGTERM" as if the user had sent it: the agent's note (written by
    launchers/torchrun_quiet.py before it ends the ranks) makes the line name the failure
    and what comes next: a restart that resumes by itself, or (none left) the
    checkpoint."""
    from hdet_scale.train.stopping import failed_message

    _attempt(monkeypatch, tmp_path, 0, 1)
    assert refusals.failure_noted() is None  # no note: a user's signal
    refusals.note_failure(os.getppid(), "rank(s) [3] killed by SIGKILL (signal 9)")
    assert refusals.failure_noted() == "rank(s) [3] killed by SIGKILL (signal 9)"
    run = {"run_dir": str(tmp_path / "run"), "train": {"checkpoint_every": 3}}
    line = failed_message(refusals.failure_noted(), run, 7)
    assert line == ("hdet-train: torchrun ended every rank at step 7 after a failure (rank(s) [3] killed by SIGKILL "
                    "(signal 9)). It restarts the job (restart 1 of 1), which starts again (no checkpoint was "
                    "saved yet) by itself."), line
    _attempt(monkeypatch, tmp_path, 1, 1)  # the last attempt: the checkpoint and train.resume
    line = failed_message("rank(s) [3] killed by SIGKILL (signal 9)", run, 7)
    assert "restart" not in line and "No checkpoint was saved yet (train.checkpoint_every=3)" in line, line
    refusals.clear_failure(os.getppid())  # the restarted ranks run: no failure is theirs
    assert refusals.failure_noted() is None
    refusals.note_failure(os.getppid(), "x")
    refusals.forget_agent(os.getppid())  # the agent ends: nothing of it is left
    assert os.listdir(refusals._folder()) == []
    monkeypatch.delenv(refusals.RESTART_VAR)  # outside torchrun: never a note
    refusals.note_failure(os.getppid(), "x")
    assert refusals.failure_noted() is None


def test_rank_0s_completed_note_reaches_the_agent_and_goes_with_it(monkeypatch, tmp_path):
    """A rank lost after the run completed is no failed run to the launchers' torchrun:
    rank 0 leaves its agent a note once summary.json is written (``said``: rank 0 printed
    the line itself, so the agent prints none); nothing outside torchrun; the agent's end
    removes it."""
    _attempt(monkeypatch, tmp_path, 0, 1)
    agent = os.getppid()
    assert refusals.completed_noted(agent) is None
    refusals.note_completed("/runs/a b", said=False)
    assert refusals.completed_noted(agent) == ("/runs/a b/summary.json", False)
    refusals.note_completed("/runs/a b", said=True)
    assert refusals.completed_noted(agent) == ("/runs/a b/summary.json", True)
    assert refusals.completed_noted(agent + 1) is None  # another agent's job
    refusals.forget_agent(agent)
    assert refusals.completed_noted(agent) is None and os.listdir(refusals._folder()) == []
    monkeypatch.delenv(refusals.RESTART_VAR)  # outside torchrun: no note
    refusals.note_completed("/runs/x", said=False)
    assert refusals.completed_noted(agent) is None


def test_a_rank_that_lost_its_peer_names_the_restart_to_come_not_a_fresh_start(monkeypatch, tmp_path):
    """Under the launchers' torchrun with restarts left and no checkpoint yet, rank 0's
    line for a lost peer names the restart, as the agent's note does, not "start again ...
    with train.overwrite=true" beside the agent's "restarts the job"; with no restart
    left, the resume advice."""
    from hdet_scale.train.stopping import after_failure

    run = {"run_dir": str(tmp_path / "run"), "train": {"checkpoint_every": 3, "steps": 20}}
    _attempt(monkeypatch, tmp_path, 0, 3)
    assert after_failure(run) == ("It restarts the job (restart 1 of 3), which starts again (no checkpoint was saved "
                                  "yet) by itself.")
    _attempt(monkeypatch, tmp_path, 3, 3)
    assert after_failure(run).startswith("No checkpoint was saved yet (train.checkpoint_every=3)")
