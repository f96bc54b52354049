"""The checkpoint folder's bookkeeping (``backends/checkpoint_io.py``) and how a trainer run
starts in its ``run_dir`` (``train/rundir.py``): file operations only, no process group.

The multi-rank saves, the kill and the resume themselves: tests/distributed/test_resume.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from hdet_scale.backends.checkpoint_io import commit, prune, read_latest, retire_tag
from hdet_scale.backends.checkpoints import read_layout
from hdet_scale.errors import HDETConfigError
from hdet_scale.train import fault_hook, run_checkpoint, rundir
from hdet_scale.train.no_latest import no_latest_message
from hdet_scale.train.config import load_run_config

REPLICAS = 2


def save(ckpt, step, tag=None):
    """What a 2-replica save leaves: each replica's folder with a file, then rank 0's commit."""
    tag = tag or f"global_step{step}"
    retire_tag(str(ckpt), REPLICAS, tag)
    for r in range(REPLICAS):
        (ckpt / f"replica_{r}" / tag).mkdir(parents=True)
        (ckpt / f"replica_{r}" / tag / "hdet_shard_0.pt").write_bytes(b"x")
    commit(str(ckpt), {"world_size": 4, "replicas": REPLICAS, "shard_size": 2, "step": step, "total_steps": 20,
                       "backend": "ddp"}, tag)
    return tag


def tags(ckpt, r=0):
    return sorted(p.name for p in (ckpt / f"replica_{r}").iterdir())


def test_keep_the_newest_and_latest_moves_last(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (4, 8, 12):
        save(ckpt, step)
        prune(str(ckpt), REPLICAS, keep=2)
    assert read_latest(str(ckpt)) == "global_step12"
    assert tags(ckpt, 0) == tags(ckpt, 1) == ["global_step12", "global_step8"]
    layout = read_layout(str(ckpt))
    assert layout["checkpoints"] == {"global_step8": 8, "global_step12": 12} and layout["step"] == 12
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]  # temp files were all replaced

    # A save cut short at 16 (one replica's folder written, no commit), and a folder under a
    # tag of the user's own: the next prune removes the leftover, keeps the user's tag.
    (ckpt / "replica_0" / "global_step16").mkdir()
    (ckpt / "replica_0" / "best").mkdir()
    assert read_latest(str(ckpt)) == "global_step12"
    prune(str(ckpt), REPLICAS, keep=2)
    assert tags(ckpt, 0) == ["best", "global_step12", "global_step8"]


def test_a_crash_between_layout_and_latest_reads_the_step_of_latest(tmp_path):
    """commit() replaces hdet_layout.json first, then latest: a crash in between leaves
    latest on the previous (complete) checkpoint, and the step read is latest's."""
    ckpt = tmp_path / "ckpt"
    save(ckpt, 4)
    save(ckpt, 8)
    (ckpt / "latest").write_text("global_step4")  # as if the crash came before latest's replace
    assert read_layout(str(ckpt))["step"] == 4
    # a layout of hdet_scale <= 0.2 (no index): its "step" is latest's
    (ckpt / "hdet_layout.json").write_text(json.dumps({"replicas": 2, "shard_size": 2, "step": 8}))
    assert read_layout(str(ckpt))["step"] == 8


def test_saving_a_tag_again_never_leaves_latest_on_a_folder_being_rewritten(tmp_path):
    ckpt = tmp_path / "ckpt"
    save(ckpt, 4)
    save(ckpt, 8, tag="last")
    retire_tag(str(ckpt), REPLICAS, "last")  # the start of a second save under "last"
    assert read_latest(str(ckpt)) == "global_step4"  # the newest other complete checkpoint
    assert not (ckpt / "replica_0" / "last").exists() and read_layout(str(ckpt))["step"] == 4
    save(ckpt, 12, tag="last")
    assert read_latest(str(ckpt)) == "last" and read_layout(str(ckpt))["checkpoints"] == {"global_step4": 4, "last": 12}
    retire_tag(str(ckpt), REPLICAS, "global_step4")
    retire_tag(str(ckpt), REPLICAS, "last")  # nothing else complete: no latest at all
    assert read_latest(str(ckpt)) is None


def test_truncated_metrics_read_like_one_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 7, "a": 1}\n{"step": 8, "a": 2}\n{"step": 8, "hdet/sync": 1}\n{"step": 9, "a": 3}\n'
                    '{"step": 10, "a"')  # the dead run's records after its checkpoint, and a torn line
    assert rundir.truncate_metrics(str(path), 8) == 2
    assert path.read_text() == '{"step": 7, "a": 1}\n{"step": 8, "a": 2}\n{"step": 8, "hdet/sync": 1}\n'


def test_the_end_converge_of_a_run_stopped_before_total_steps_is_dropped_at_its_resume(tmp_path):
    """A run stopped at step 8 of a longer schedule saved each replica, then averaged them
    for its evaluation (logged ``hdet/final_converge`` without ``hdet/sync``); its resume
    goes on from the saved replicas, so that record goes; the final converge of a sync
    step (with ``hdet/sync``) and earlier ones stay."""
    path = tmp_path / "metrics.jsonl"
    kept = '{"step": 6, "hdet/final_converge": 1}\n{"step": 8, "a": 2}\n{"step": 8, "hdet/sync": 2, "hdet/final_converge": 1}\n'
    path.write_text(kept + '{"step": 8, "hdet/step": 8, "hdet/final_converge": 1, "hdet/converge_s": 0.1}\n')
    assert rundir.truncate_metrics(str(path), 8) == 1
    assert path.read_text() == kept
    # logging.every 3, stopped at 8 (its last step, always logged): the uninterrupted run
    # has no per-step record at 8; its sync record there stays
    path.write_text('{"step": 6, "hdet/loss": 1.0}\n{"step": 8, "hdet/loss": 0.9}\n{"step": 8, "hdet/sync": 2}\n')
    assert rundir.truncate_metrics(str(path), 8, every=3) == 1
    assert path.read_text() == '{"step": 6, "hdet/loss": 1.0}\n{"step": 8, "hdet/sync": 2}\n'


def test_a_resume_whose_metrics_were_deleted_or_cut_notes_the_gap(tmp_path, capsys):
    """A resume after metrics.jsonl was deleted or cut short by hand does not append
    after a gap without a word: the trim notes the steps whose records are gone; a file
    holding the last logged step (every 4: step 8 for a checkpoint at 10) gets no
    note."""
    from hdet_scale.train import rundir

    run = {"run_dir": str(tmp_path)}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}}}\n' for s in (4, 8, 12)))
    rundir.trim_for_resume(run, 10, every=4)
    assert capsys.readouterr().err == "" and path.read_text() == '{"step": 4}\n{"step": 8}\n'
    path.write_text('{"step": 4}\n{"step": 5, "hdet/lo')  # cut short by hand, mid-line
    rundir.trim_for_resume(run, 10, every=4)
    assert capsys.readouterr().err == (
        f"hdet-train: note: {path} holds records up to step 4 only, though the checkpoint is at step 10: the "
        "records of steps 5-10 are gone, and the resumed run appends from step 11 on\n")
    path.unlink()
    rundir.trim_for_resume(run, 10, every=1)
    assert f"{path} holds no record, though the checkpoint is at step 10: the records of steps 1-10" in \
        capsys.readouterr().err
    rundir.trim_for_resume(run, 3, every=4)  # nothing logged before step 4: no gap
    assert capsys.readouterr().err == ""


def test_a_tail_of_bytes_that_are_not_utf8_is_dropped_like_a_torn_line(tmp_path):
    """Random bytes appended to metrics.jsonl are a damaged tail, dropped at resume, the
    records kept as written, not a UnicodeDecodeError on every rank."""
    path = tmp_path / "metrics.jsonl"
    good = '{"step": 7, "a": 1}\n{"step": 8, "a": 2}\n'
    path.write_bytes(good.encode() + b"\x90\xff\x00garbage\n\x80\x81")
    assert rundir.truncate_metrics(str(path), 8) == 2
    assert path.read_text() == good


def outside_torchrun(monkeypatch):
    """No torchrun attempt in the environment: start_mode judges the run_dir as a first start."""
    for var in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _run_dir_with_a_run(tmp_path, latest=True):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint" / "replica_0" / "global_step4").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 4}\n{"step": 5}\n')
    (run_dir / "summary.json").write_text("{}")
    if latest:
        (run_dir / "checkpoint" / "latest").write_text("global_step4")
        (run_dir / "checkpoint" / "hdet_layout.json").write_text(json.dumps({"step": 4}))
    return run_dir


def test_a_new_run_resumes_or_refuses_and_overwrite_clears_the_old_checkpoint(tmp_path, monkeypatch):
    outside_torchrun(monkeypatch)
    run_dir = _run_dir_with_a_run(tmp_path)

    def cfg(*overrides):
        return load_run_config(None, [f"run_dir={run_dir}", *overrides])

    with pytest.raises(HDETConfigError, match="train.resume=true.*train.overwrite=true"):
        rundir.start_mode(cfg())
    assert rundir.start_mode(cfg("train.resume=true")) == "resume"
    assert rundir.start_mode(cfg("train.resume=true", "train.overwrite=true")) == "resume"  # resuming wins

    # Preparing a resume changes nothing (a resume whose load fails must lose nothing); the
    # trim follows the load.
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    rundir.prepare_run_dir(cfg("train.resume=true"), "resume")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    # the step the load restored, not the index's (an index claiming step 5 for global_step4
    # would keep step 5's record, which the resumed run then writes again)
    (run_dir / "checkpoint" / "hdet_layout.json").write_text(json.dumps({"step": 5}))
    rundir.trim_for_resume(cfg("train.resume=true"), 4)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 4}\n' and not (run_dir / "summary.json").exists()

    assert rundir.start_mode(cfg("train.overwrite=true")) == "replace"
    rundir.prepare_run_dir(cfg("train.overwrite=true"), "replace")
    assert sorted(p.name for p in run_dir.iterdir()) == []  # no old latest to mix with the new run's


def test_a_checkpoint_folder_holding_a_users_files_is_never_replaced(tmp_path, monkeypatch):
    """A ``checkpoint/`` with files hdet-train does not write (a user's ``my_model.bin``,
    which must not be called "a run" and removed by ``train.overwrite=true``) is refused
    for a fresh run and an overwrite alike, naming the file; nothing is removed. The same
    run_dir with hdet-train's own files only (the index, the record, a temporary,
    ``replica_<r>``) is replaced, and a resume is not judged."""
    outside_torchrun(monkeypatch)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "my_model.bin").write_text("mine")

    def cfg(*overrides):
        return load_run_config(None, [f"run_dir={run_dir}", *overrides])

    for overrides in ((), ("train.overwrite=true",)):
        with pytest.raises(HDETConfigError, match="did not write \\(my_model.bin\\)") as e:
            rundir.start_mode(cfg(*overrides))
        assert str(run_dir / "checkpoint") in str(e.value) and "already holds a run" not in str(e.value)
    assert (run_dir / "checkpoint" / "my_model.bin").read_text() == "mine"
    (run_dir / "checkpoint" / "my_model.bin").unlink()
    assert _run_dir_with_a_run(tmp_path) == run_dir  # the same run_dir, now with a run's files
    (run_dir / "checkpoint" / "hdet_run_config.json").write_text('{"runs": {}}')
    (run_dir / "checkpoint" / "latest.tmp123").write_text("global_step")
    assert rundir.start_mode(cfg("train.resume=true")) == "resume"
    (run_dir / "checkpoint" / "notes.txt").write_text("mine")
    assert rundir.start_mode(cfg("train.resume=true")) == "resume"  # a resume removes no folder
    with pytest.raises(HDETConfigError, match="notes.txt"):
        rundir.start_mode(cfg("train.overwrite=true"))
    (run_dir / "checkpoint" / "notes.txt").unlink()
    assert rundir.start_mode(cfg("train.overwrite=true")) == "replace"


def test_a_torchrun_restart_resumes_only_its_own_job(tmp_path, monkeypatch):
    """TORCHELASTIC_RESTART_COUNT > 0 with the run id in run_dir/job.json: this job's
    crashed attempt, resumed (or, before its first checkpoint, replaced) without
    train.resume. Another job's files (another or no id, or torchrun's default id "none")
    are refused as without a restart: a job refused at its first attempt stays refused."""
    run_dir = _run_dir_with_a_run(tmp_path)
    cfg = load_run_config(None, [f"run_dir={run_dir}"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    rundir.prepare_run_dir(cfg, "fresh")  # what the first attempt's rank 0 records
    with pytest.raises(HDETConfigError, match="already holds a run"):
        rundir.start_mode(cfg)  # a first attempt never resumes by itself
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert rundir.start_mode(cfg) == "resume"
    (run_dir / "checkpoint" / "latest").unlink()
    assert rundir.start_mode(cfg) == "replace"
    for other in ("job-b", "none"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", other)
        with pytest.raises(HDETConfigError, match="train.overwrite=true"):
            rundir.start_mode(cfg)


def test_the_fault_hook_is_checked_and_fires_in_a_first_attempt_only(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(fault_hook.FAULT_ENV, "3:10")
    assert fault_hook.fault_point() == (3, 10)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_hook.fault_point() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(fault_hook.FAULT_ENV, "3")
    with pytest.raises(HDETConfigError, match=fault_hook.FAULT_ENV):
        fault_hook.fault_point()


def test_a_fault_hook_that_could_never_fire_is_refused(monkeypatch):
    """Against the world size and train.steps, the hook's rank must be in [0, W) and its
    step in [1, steps]: otherwise the test that set it would pass without its kill
    (so no such value is accepted silently)."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for ok in ("0:1", "3:12"):
        monkeypatch.setenv(fault_hook.FAULT_ENV, ok)
        assert fault_hook.fault_point(4, 12) == tuple(int(x) for x in ok.split(":"))
    for bad in ("4:5", "-1:5", "3:0", "3:13"):
        monkeypatch.setenv(fault_hook.FAULT_ENV, bad)
        with pytest.raises(HDETConfigError) as err:
            fault_hook.fault_point(4, 12)
        assert f"{fault_hook.FAULT_ENV}='{bad}'" in str(err.value) and "rank in [0, 3]" in str(err.value) \
            and "step in [1, 12]" in str(err.value), str(err.value)


def test_a_diverged_runs_summary_is_strict_json():
    # json.dump writes NaN / Infinity, which strict JSON readers refuse: null instead.
    import json as _json

    from hdet_scale.logging import json_safe

    s = json_safe({"val_loss": float("nan"), "val_ppl": float("inf"), "peak": [1.5, float("-inf")], "n": 3},
                  nonfinite=lambda x: None)
    assert _json.loads(_json.dumps(s, allow_nan=False)) == {"val_loss": None, "val_ppl": None, "peak": [1.5, None],
                                                            "n": 3}


def test_write_atomic_removes_the_temp_files_a_stopped_write_left(tmp_path):
    """A rank stopped by a signal mid-save (``os._exit``) leaves ``latest.tmp<pid>``
    behind: the next write of the same file removes the temp files of processes that are
    gone (a real child, ended by SIGKILL after it wrote one), keeps a live process's
    (this test's parent: a write in progress) and other files'."""
    import os
    import signal
    import subprocess
    import sys

    from hdet_scale.backends.checkpoint_io import write_atomic

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    script = ("import os, sys, time; open(f'{sys.argv[1]}.tmp{os.getpid()}', 'w').write('glob'); "
              "print(flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script, str(ckpt / "latest")], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()  # its temp file is written
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    dead = ckpt / f"latest.tmp{child.pid}"
    live = ckpt / f"latest.tmp{os.getppid()}"
    other = ckpt / f"hdet_layout.json.tmp{child.pid}"  # another file's: left to that file's next write
    live.write_text("x")
    other.write_text("x")
    assert dead.exists()
    write_atomic(str(ckpt / "latest"), "global_step4")
    assert read_latest(str(ckpt)) == "global_step4"
    assert not dead.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["latest", live.name, other.name])


def test_a_replica_folder_copied_from_another_place_is_refused_before_loading(tmp_path):
    """A whole replica folder copied from another replica or another tag brings its own
    manifest, so sizes and CRC-32s all match; the resume would then hang (replicas at
    different steps) or silently give replica 1 replica 0's state. The manifest records
    the folder it was written for, and the pre-start check compares."""
    from hdet_scale.backends.manifest import MANIFEST_FILE, listing_problem

    def folder(replica, tag, written_for):
        d = tmp_path / f"replica_{replica}" / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.pt").write_bytes(b"x" * 10)
        (d / MANIFEST_FILE).write_text(json.dumps({"files": {"model.pt": [10, 0]}, **written_for}))
        return str(d)

    assert listing_problem(folder(1, "global_step5", {"replica": 1, "tag": "global_step5"}), True) is None
    problem = listing_problem(folder(1, "global_step6", {"replica": 0, "tag": "global_step6"}), True)
    assert "saved as replica_0/global_step6, not replica_1/global_step6" in problem
    problem = listing_problem(folder(1, "global_step7", {"replica": 1, "tag": "global_step10"}), True)
    assert "saved as replica_1/global_step10, not replica_1/global_step7" in problem
    assert listing_problem(folder(1, "global_step8", {}), True) is None  # an older save's manifest: not recorded


def test_a_deleted_replica_folder_names_the_older_complete_checkpoint_to_resume_from(tmp_path):
    """With a replica folder of latest's tag deleted, train.resume=true names the older
    complete checkpoints and how to resume from one, as a damaged file's message does,
    not only "has no folder for replica(s) [0, 1] at tag 'global_step20'" (and a lost
    HDET state file too)."""
    import shutil

    from hdet_scale.backends.checkpoints import check_resumable
    from hdet_scale.errors import HDETStateError

    ckpt = tmp_path / "checkpoint"
    for step in (5, 10, 20):
        save(ckpt, step)
        for r in range(REPLICAS):  # the second shard's file, which save() leaves out
            (ckpt / f"replica_{r}" / f"global_step{step}" / "hdet_shard_1.pt").write_bytes(b"x")
    advice = "restore them from a copy, resume from another complete checkpoint by writing its tag into latest ("
    (ckpt / "replica_1" / "global_step20" / "hdet_shard_0.pt").unlink()
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert str(err.value).startswith(f"checkpoint {ckpt} is incomplete: missing replica_1/global_step20/hdet_shard_0.pt; "
                                     f"{advice}"), err.value
    assert "global_step10 (step 10)" in str(err.value) and str(err.value).endswith("or start a new run_dir")
    for r in range(REPLICAS):
        shutil.rmtree(ckpt / f"replica_{r}" / "global_step20")
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert str(err.value).startswith(f"checkpoint {ckpt} has no folder for replica(s) [0, 1] at tag 'global_step20'; "
                                     f"{advice}"), err.value
    assert "global_step10 (step 10)" in str(err.value)
    # a replica folder gone from two tags: neither is offered as the way on from the other.
    # Only a tag whose folders are all there is offered (global_step5).
    shutil.rmtree(ckpt / "replica_0" / "global_step10")
    (ckpt / "latest").write_text("global_step10")
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert "latest (global_step5 (step 5)), or start a new run_dir" in str(err.value), err.value
    shutil.rmtree(ckpt / "replica_1" / "global_step5")
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert str(err.value).endswith("has no folder for replica(s) [0] at tag 'global_step10'; restore them from a "
                                   "copy, or start a new run_dir"), err.value


def test_a_cut_short_archive_is_named_once(tmp_path):
    """A ``model_optim.pt`` truncated to 1000 bytes is named once, by the first
    explanation (a torch.save archive without its directory), not twice, also as a size
    that differs from the manifest's: one file, one explanation."""
    import zlib

    import torch

    from hdet_scale.backends.checkpoints import check_resumable
    from hdet_scale.backends.manifest import MANIFEST_FILE
    from hdet_scale.errors import HDETStateError

    ckpt = tmp_path / "checkpoint"
    tag = save(ckpt, 5)
    for r in range(REPLICAS):
        folder = ckpt / f"replica_{r}" / tag
        (folder / "hdet_shard_1.pt").write_bytes(b"x")
        torch.save({"w": torch.arange(4096.0)}, folder / "model_optim.pt")
        files = {p.name: [p.stat().st_size, zlib.crc32(p.read_bytes())] for p in folder.iterdir()}
        (folder / MANIFEST_FILE).write_text(json.dumps({"files": files, "replica": r, "tag": tag}))
    check_resumable(str(ckpt), 4, REPLICAS, "ddp")  # whole: accepted
    cut = ckpt / "replica_0" / tag / "model_optim.pt"
    os.truncate(cut, 1000)
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert str(err.value).count(str(cut)) == 1, err.value
    assert f"{cut}: truncated or damaged (1000 bytes;" in str(err.value), err.value
    # with no other checkpoint the advice is not "; or start a new run_dir" alone
    assert str(err.value).endswith("; restore them from a copy, or start a new run_dir"), err.value
    # a second file of the folder, cut by the size alone, is still named by the manifest
    (ckpt / "replica_1" / tag / "hdet_shard_0.pt").write_bytes(b"xy")
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert "hdet_shard_0.pt (not the file this checkpoint saved there: 2 bytes" in str(err.value), err.value
    assert str(err.value).count(str(cut)) == 1, err.value


def test_a_run_dir_in_use_is_named_before_its_files_are_judged(tmp_path):
    """``train.resume=true`` into a run_dir a running job holds is not told to start over
    (its checkpoint not written yet): the launcher asks the lock first, without taking
    it: held by another process -> the in-use message; free -> nothing, and the lock
    stays takeable."""
    import subprocess
    import sys
    import time

    from hdet_scale.errors import HDETConfigError
    from hdet_scale.train.rundir import check_not_in_use, hold_run_dir

    check_not_in_use(str(tmp_path))  # no lock file: nothing to say
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hdet_scale.train.rundir import "
                               "hold_run_dir; hold_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(30)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(HDETConfigError, match=r"is in use by a running hdet-train \(pid \d+"):
            check_not_in_use(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    check_not_in_use(str(tmp_path))  # released with its process
    hold_run_dir(str(tmp_path))  # and takeable: the check took nothing


def test_a_run_dir_in_use_is_refused_before_torch_is_imported(tmp_path):
    """``hdet-train`` refuses with exit 2 having imported neither torch nor DeepSpeed
    (``-X importtime`` lists every module the process imported): importing them before the
    check would take 24-30 s on a loaded machine."""
    import subprocess
    import sys
    import time

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hdet_scale.train.run_lock import "
                               "hold_run_dir; hold_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hdet_scale.train.cli", f"run_dir={tmp_path}",
                               "wandb.enabled=false"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        seconds = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    lines = done.stderr.splitlines()
    said = [line for line in lines if not line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    assert done.returncode == 2 and len(said) == 1 and "is in use by a running hdet-train" in said[0], done.stderr[-2000:]
    assert not imported & {"torch", "deepspeed", "numpy"}, sorted(imported & {"torch", "deepspeed", "numpy"})
    assert seconds < 10, seconds  # ~1 s measured; the torch import alone took 2-30 s


def test_overwrite_removes_a_link_in_the_run_dir_not_its_target(tmp_path):
    """A run_dir whose checkpoint/ and metrics.jsonl are links to another run's is
    overwritten without raising in rmtree on rank 0: the links go; the other run stays."""
    other = tmp_path / "other"
    (other / "checkpoint").mkdir(parents=True)
    (other / "checkpoint" / "latest").write_text("global_step4")
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint").symlink_to(other / "checkpoint")
    (run_dir / "metrics.jsonl").symlink_to(other / "metrics.jsonl")
    rundir._remove(str(run_dir / "checkpoint"))
    rundir._remove(str(run_dir / "metrics.jsonl"))
    assert not os.path.lexists(run_dir / "checkpoint") and not os.path.lexists(run_dir / "metrics.jsonl")
    assert (other / "checkpoint" / "latest").read_text() == "global_step4"
    assert (other / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_save_on_a_full_disk_is_named_with_the_checkpoint_that_is_intact(tmp_path):
    """A save on a full disk (a 26 MB tmpfs) would end both ranks with torch's tracebacks
    ("basic_ios::clear: iostream error", "unexpected pos") and no word of the disk or of
    the checkpoint left intact: it is named. The real errors: writing to /dev/full
    (ENOSPC), and torch.save into it (torch's RuntimeError, no errno: named by the space
    left, here with a threshold above this disk's free space, as a full disk has below 64
    MiB)."""
    import errno as errno_mod

    import torch

    from hdet_scale.errors import HDETStateError

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    with pytest.raises(OSError) as e:
        with open("/dev/full", "w") as f:
            f.write("x")
    assert e.value.errno == errno_mod.ENOSPC
    err = run_checkpoint.save_error(str(ckpt), 20, e.value)
    assert isinstance(err, HDETStateError), err
    assert f"the save of step 20 into {ckpt} failed, the disk is full" in str(err)
    assert "no checkpoint is complete yet" in str(err)
    # not "free space, then start again", which the run_dir's files of this attempt would
    # refuse (and train.resume=true too): it names the way that is taken,
    # train.overwrite=true, held here to start_mode on that attempt's run_dir
    assert "start the run over with train.overwrite=true" in str(err), err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')

    def mode(*overrides):
        return rundir.start_mode(load_run_config(None, [f"run_dir={tmp_path}", *overrides]))

    for refused in ((), ("train.resume=true",)):
        with pytest.raises(HDETConfigError):
            mode(*refused)
    assert mode("train.overwrite=true") == "replace"
    (ckpt / "latest").write_text("global_step10")
    with pytest.raises(RuntimeError) as e:
        torch.save({"w": torch.zeros(10**6)}, "/dev/full")
    err = run_checkpoint.save_error(str(ckpt), 20, e.value, low_bytes=2**62)
    assert isinstance(err, HDETStateError) and "latest still names global_step10, complete" in str(err), err
    assert run_checkpoint.save_error(str(ckpt), 20, e.value) is e.value  # room left: torch's error is not a full disk


_SAVE_UNDER_A_LIMIT = r"""
import json, sys

import torch

from hdet_scale.train import run_checkpoint

ckpt = sys.argv[1]
out = {}
try:
    torch.save({"w": torch.zeros(10**5)}, ckpt + "/model.pt")  # torch's writer: no errno
except RuntimeError as e:
    out["torch"] = str(run_checkpoint.save_error(ckpt, 30, e))
try:
    with open(ckpt + "/state.bin", "wb") as f:
        f.write(b"x" * 20000)
except OSError as e:
    out["efbig"] = [e.errno, str(run_checkpoint.save_error(ckpt, 30, e))]
print(json.dumps(out))
"""


def test_a_save_stopped_by_the_file_size_limit_or_a_quota_is_named(tmp_path):
    """Under ``ulimit -f`` the final save would fail in every rank with torch's "unexpected
    pos" RuntimeError (no errno) and a traceback; a quota (EDQUOT) and EFBIG are recognised
    too. Each is one HDETStateError naming the cause, the folder and the way on. The limit
    is real here: a child process under RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write
    fails with EFBIG)."""
    import errno as errno_mod
    import resource
    import subprocess
    import sys

    from hdet_scale.errors import HDETStateError

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "latest").write_text("global_step20")
    limit = 8192
    child = subprocess.run([sys.executable, "-c", _SAVE_UNDER_A_LIMIT, str(ckpt)], capture_output=True, text=True,
                           timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    named = f"the file size limit of this process (ulimit -f: {limit} bytes)"
    for msg in (out["torch"], out["efbig"][1]):
        assert msg.startswith(f"checkpoint: the save of step 30 into {ckpt} failed, a file reached {named}"), msg
        assert msg.endswith("latest still names global_step20, complete; raise the limit (ulimit -f unlimited), "
                            "then train.resume=true continues from it"), msg
    assert out["efbig"][0] == errno_mod.EFBIG, out
    (ckpt / "latest").unlink()
    quota = OSError(errno_mod.EDQUOT, "Disk quota exceeded", str(ckpt / "model.pt"))
    err = run_checkpoint.save_error(str(ckpt), 30, quota)
    assert isinstance(err, HDETStateError), err
    assert f"into {ckpt} failed, the disk quota is exceeded" in str(err) and "model.pt" in str(err), err
    assert "no checkpoint is complete yet" in str(err) and "start the run over with train.overwrite=true" in str(err)
    # without a finite limit here, torch's errno-less error with room left is not ours to name
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY
    other = RuntimeError("unexpected pos 704 vs 598")
    assert run_checkpoint.save_error(str(ckpt), 30, other) is other


@pytest.mark.parametrize("resume", [True, False])
def test_a_checkpoint_folder_given_as_run_dir_is_refused_naming_the_run(tmp_path, resume):
    """``run_dir=<run>/checkpoint train.resume=true`` (the Hugging Face habit of naming
    the checkpoint folder) would start from step 0 without a word, writing into the
    other run's checkpoint folder: refused, naming the run's own folder."""
    run_dir = _run_dir_with_a_run(tmp_path)
    ckpt = run_dir / "checkpoint"
    run = load_run_config(None, [f"run_dir={ckpt}", f"train.resume={str(resume).lower()}"])
    with pytest.raises(HDETConfigError, match=rf"run_dir: {ckpt} is a checkpoint folder \(it holds hdet_layout.json\); "
                                              rf"give the run's own folder, run_dir={run_dir}"):
        rundir.start_mode(run)


def test_a_stop_before_anything_was_written_does_not_ask_for_overwrite(tmp_path):
    """A stop before the first step does not say "start again in RUN with
    train.overwrite=true" where the run_dir holds only the lock and a plain rerun works.
    With the stopped run's metrics there, overwrite is still the way (a rerun is
    refused)."""
    import signal

    from hdet_scale.train.stopping import stop_message

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".hdet_run.lock").write_text("")
    run = load_run_config(None, [f"run_dir={run_dir}"])
    msg = stop_message(signal.SIGINT, run, "all 2 ranks ended", None)
    assert msg.endswith(f"start again with the same command (no checkpoint or metrics of this run were written "
                        f"in {run_dir})."), msg
    # W&B's offline run folder of the stopped attempt stays, and is named
    (run_dir / "wandb" / "offline-run-20250101_000000-old").mkdir(parents=True)
    os.utime(run_dir / "wandb" / "offline-run-20250101_000000-old", (1, 1))
    (run_dir / "wandb" / "offline-run-20250102_000000-abc").mkdir()
    (run_dir / "wandb" / "debug.log").write_text("")
    msg = stop_message(signal.SIGINT, run, "all 2 ranks ended", None)
    assert msg.endswith(f"start again with the same command (no checkpoint or metrics of this run were written in "
                        f"{run_dir}; W&B's run folder {run_dir}/wandb/offline-run-20250102_000000-abc stays)."), msg
    assert "nothing of this run is kept" not in msg
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "with train.overwrite=true" in stop_message(signal.SIGINT, run, "all 2 ranks ended", 1)


def test_a_stop_before_an_overwrite_replaced_the_earlier_run_names_no_checkpoint_of_it(tmp_path, monkeypatch):
    """A ``train.overwrite=true`` run stopped before its start replaced the earlier,
    completed run is not told "Last checkpoint: .../global_step40; continue with
    train.resume=true", the earlier run's checkpoint, whose resume would be refused
    (nothing left to do). A ``latest`` older than this process is no save of this run's,
    unless this run resumes it (train.resume, or a torchrun restart of the job)."""
    import signal

    from hdet_scale.train.stopping import stop_message

    outside_torchrun(monkeypatch)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "latest").write_text("global_step40")
    (run_dir / "metrics.jsonl").write_text('{"step": 40}\n')
    old = time.time() - 3600
    os.utime(run_dir / "checkpoint" / "latest", (old, old))
    run = load_run_config(None, [f"run_dir={run_dir}", "train.overwrite=true"])
    msg = stop_message(signal.SIGINT, run, "all 2 ranks ended", None)
    assert msg.endswith(f"No checkpoint of this run was saved: {run_dir}/checkpoint/replica_*/global_step40 is the "
                        f"earlier run's in {run_dir}, which this run had not yet replaced (nothing of it was "
                        "changed); start again with the same command."), msg
    resumed = load_run_config(None, [f"run_dir={run_dir}", "train.resume=true"])
    assert "continue with train.resume=true" in stop_message(signal.SIGINT, resumed, "all 2 ranks ended", 41)
    os.utime(run_dir / "checkpoint" / "latest")  # saved by this process: this run's own
    assert "continue with train.resume=true" in stop_message(signal.SIGINT, run, "all 2 ranks ended", 3)


def test_a_new_run_refuses_a_plots_folder_holding_files_of_its_plots_names(tmp_path, monkeypatch):
    """A new run in a run_dir holding no run but a user's own ``plots/loss.png`` would
    replace it at the end without a word: refused before the start (the launcher's
    validate calls start_mode), naming the file and the ways on; a user's other files
    there (notes.txt) are no obstacle, nor is the folder with train.plots=false or
    train.overwrite=true."""
    outside_torchrun(monkeypatch)
    run_dir = tmp_path / "proj"
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "plots" / "notes.txt").write_text("my notes")

    def mode(*overrides):
        return rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", *overrides]))

    assert mode() == "fresh"  # a file of another name is never touched by the plots
    (run_dir / "plots" / "loss.png").write_bytes(b"MY OWN LOSS PLOT")
    with pytest.raises(HDETConfigError) as e:
        mode()
    assert str(e.value) == (f"run_dir: {run_dir}/plots already holds loss.png, of the names this run gives its plots "
                            "at its end (it would replace them): move them away, choose another run_dir, set "
                            "train.plots=false, or train.overwrite=true to replace them")
    assert mode("train.plots=false") == "fresh" and mode("train.overwrite=true") == "fresh"
    assert (run_dir / "plots" / "loss.png").read_bytes() == b"MY OWN LOSS PLOT"
    # an earlier run's plots in this run_dir, recorded as drawn from its metrics: replaced
    # by this run's (the record is what hdet-train and hdet-plot write with them)
    from hdet_scale.plot_out import RECORD

    record = {"metrics": os.path.realpath(run_dir / "metrics.jsonl"), "pngs": ["loss.png"]}
    (run_dir / "plots" / RECORD).write_text(json.dumps(record))
    assert mode() == "fresh"
    (run_dir / "plots" / "sync.png").write_bytes(b"not listed")
    with pytest.raises(HDETConfigError, match=r"plots already holds sync.png, of the names"):
        mode()


def test_a_full_disk_under_the_settings_record_or_inside_dcps_exception_is_named(tmp_path, monkeypatch):
    """A save's first write is rank 0's settings record, and FSDP2's DCP wraps every rank's
    failure in a CheckpointException: a full disk or quota in either was a raw traceback
    (only the engine's own OSError / RuntimeError was named)."""
    import errno as errno_mod
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    from hdet_scale.errors import HDETStateError
    from hdet_scale.train import resume_config

    sched = SimpleNamespace(step_count=20, topology=SimpleNamespace(rank=0))

    def record_fails(*args, **kwargs):
        raise OSError(errno_mod.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(resume_config, "save_record", record_fails)
    engine = SimpleNamespace(scheduler=sched, save=lambda path: None)
    with pytest.raises(HDETStateError, match=r"failed, the disk quota is exceeded .*train.overwrite=true"):
        run_checkpoint.save(engine, str(tmp_path), 2, run={"train": {}})
    monkeypatch.undo()

    def dcp_fails(path):
        raise CheckpointException("save", {0: (OSError(errno_mod.ENOSPC, "No space left on device"), None)})

    engine = SimpleNamespace(scheduler=sched, save=dcp_fails)
    with pytest.raises(HDETStateError, match=r"the save of step 20 into .* failed, the disk is full"):
        run_checkpoint.save(engine, str(tmp_path), 2)

    def dcp_other(path):
        raise CheckpointException("save", {0: (ValueError("not a disk problem"), None)})

    with pytest.raises(CheckpointException):  # anything else: DCP's own exception, as before
        run_checkpoint.save(SimpleNamespace(scheduler=sched, save=dcp_other), str(tmp_path), 2)


def test_a_stop_after_the_run_completed_names_hdet_plot_when_its_plots_were_not_written(tmp_path):
    """A SIGINT during the end-of-run plots names hdet-plot, not "nothing is lost" with
    exit 0 and plots/ never written. A plot of this attempt (newer than its start) or
    train.plots=false: no such words."""
    import time

    from hdet_scale.train.stopping import completed_message

    run = {"run_dir": str(tmp_path), "train": {"plots": True}}
    since = time.time()
    line = completed_message(2, run, since)
    assert line == (f"hdet-train: SIGINT (Ctrl-C) came after the run completed ({tmp_path / 'summary.json'} written, "
                    f"final checkpoint saved): nothing is lost and nothing is left to resume; its plots were not "
                    f"all written: hdet-plot {tmp_path} writes them.")
    (tmp_path / "plots").mkdir()
    old = tmp_path / "plots" / "loss.png"
    old.write_bytes(b"png")
    os.utime(old, (since - 3600,) * 2)  # an earlier attempt's plot does not count
    assert "hdet-plot" in completed_message(2, run, since)
    (tmp_path / "plots" / "lr.png").write_bytes(b"png")  # no record: an older hdet-plot's folder
    assert completed_message(2, run, since).endswith("nothing is left to resume.")
    # a stop half-way through the plots (one PNG of several written) says they are not all written; the
    # record says complete only after the last PNG (plot_out.PlotsFolder.finish)
    from hdet_scale.plot_out import claim

    shutil.rmtree(tmp_path / "plots")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    folder = claim(str(tmp_path))
    folder.create()
    folder.add("loss.png")
    (tmp_path / "plots" / "loss.png").write_bytes(b"png")
    assert "its plots were not all written" in completed_message(2, run, since)
    folder.finish()
    assert completed_message(2, run, since).endswith("nothing is left to resume.")
    assert "hdet-plot" not in completed_message(2, {**run, "train": {"plots": False}}, since)
    assert completed_message("rank(s) [1] killed by SIGKILL (signal 9)", run, since).startswith(
        "hdet-train: rank(s) [1] killed by SIGKILL (signal 9) after the run completed (")


def test_a_save_refused_by_permissions_is_one_line_naming_the_folder(tmp_path):
    """A save into a folder the run may not write (made read-only during the run; a
    resume into one is refused before any rank starts) is named, not a PermissionError
    traceback. A real EACCES here: creating a file in sysfs, which refuses it even to
    root."""
    from hdet_scale.errors import HDETStateError

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "latest").write_text("global_step10")
    with pytest.raises(PermissionError) as e:
        open("/sys/hdet_save_test", "w")
    err = run_checkpoint.save_error(str(ckpt), 20, e.value)
    assert isinstance(err, HDETStateError), err
    assert str(err).startswith(f"checkpoint: the save of step 20 into {ckpt} failed, a file or folder there is not "
                               "writable (")
    assert ("latest still names global_step10, complete; make it writable (chmod -R u+w on its folder), then "
            "train.resume=true continues from it") in str(err)
    assert "'/sys/hdet_save_test'" in str(err)  # the file that was refused, named by the error's reason


def test_a_resume_into_read_only_files_is_refused_before_it_starts(tmp_path):
    """The check behind the resume_*_read_only rows of tests/distributed/test_bad_inputs.py:
    every path the resumed run writes, by its mode bits (root writes anyway: the user
    marked it read-only) and os.access; writable ones pass."""
    from hdet_scale.errors import HDETStateError

    run = tmp_path / "run"
    ckpt = run / "checkpoint"
    (ckpt / "replica_0").mkdir(parents=True)
    for name in ("metrics.jsonl", "summary.json"):
        (run / name).write_text("{}\n")
    (ckpt / "latest").write_text("global_step5")
    run_checkpoint.check_resume_writable(str(run), str(ckpt))  # all writable: no error
    for path in (run / "summary.json", ckpt / "latest", ckpt / "replica_0"):
        os.chmod(path, 0o555 if path.is_dir() else 0o444)
    with pytest.raises(HDETStateError) as e:
        run_checkpoint.check_resume_writable(str(run), str(ckpt))
    assert str(e.value).startswith(f"train.resume: {run}/summary.json, {ckpt}/latest, {ckpt}/replica_0 are "
                                   "read-only, and the resumed run appends"), str(e.value)


@pytest.mark.parametrize("key", ["run_dir", "wandb.dir"])
def test_a_run_dir_that_is_a_file_or_a_device_is_named_as_not_a_folder(tmp_path, monkeypatch, key):
    """``run_dir=afile`` (a regular file) and ``run_dir=/dev/null`` are named as no
    folder, not "cannot write to afile: File exists" (makedirs' error). ``wandb.dir``
    takes the same check (validate.py)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("kept\n")
    with pytest.raises(HDETConfigError) as e:
        rundir.check_writable("afile", key=key)
    assert str(e.value).startswith(f"{key}: afile is a file, not a folder: "), e.value
    assert f"choose another {key}" in str(e.value) and "File exists" not in str(e.value)
    assert (tmp_path / "afile").read_text() == "kept\n"  # left as it was
    with pytest.raises(HDETConfigError) as e:
        rundir.check_writable(os.devnull, key=key)
    assert str(e.value).startswith(f"{key}: {os.devnull} is not a folder: "), e.value
    rundir.check_writable("afolder", key=key)  # a folder still passes (created)
    assert (tmp_path / "afolder").is_dir()


def test_a_run_inside_another_runs_checkpoint_folder_is_refused_and_never_removed(tmp_path, monkeypatch):
    """run_dir=runs/A/checkpoint/mine would be removed with A's checkpoint folder by
    hdet-train run_dir=runs/A train.overwrite=true (its lock held or not): a new run
    there is refused naming A; a run put there anyway stops A's overwrite before
    anything is removed. A run_dir beside the checkpoint folder is fine (overwrite
    removes only metrics, summary, checkpoint and the plots)."""
    outside_torchrun(monkeypatch)
    outer = _run_dir_with_a_run(tmp_path)
    nested = outer / "checkpoint" / "mine"

    def mode(run_dir, *overrides):
        return rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", *overrides]))

    with pytest.raises(HDETConfigError) as e:
        mode(nested)
    assert str(e.value) == (f"run_dir: {nested} is inside {outer / 'checkpoint'}, the checkpoint folder of the run in "
                            f"{outer}, which that run's train.overwrite=true removes with everything in it; choose a "
                            "run_dir outside it")
    assert mode(outer / "beside") == "fresh"
    nested.mkdir()
    (nested / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(HDETConfigError) as e:
        mode(outer, "train.overwrite=true")
    assert str(e.value) == (f"train.overwrite: {outer / 'checkpoint'}, which it removes, holds another run's folder "
                            f"({nested}); move that run out of it first, or choose another run_dir")
    (nested / "metrics.jsonl").unlink()
    (nested / ".hdet_run.lock").write_text("")  # a live run holds its lock before its first record
    with pytest.raises(HDETConfigError, match="holds another run's folder"):
        mode(outer, "train.overwrite=true")
    (nested / ".hdet_run.lock").unlink()
    with pytest.raises(HDETConfigError, match="did not write \\(mine\\)"):  # a user's folder, even empty
        mode(outer, "train.overwrite=true")
    nested.rmdir()
    assert mode(outer, "train.overwrite=true") == "replace"  # nothing of another run inside: replaced as before


def test_a_run_without_a_checkpoint_is_not_offered_a_resume(tmp_path, monkeypatch):
    """A run stopped before its first save leaves metrics.jsonl and no checkpoint/; the
    refusal of a second start does not offer train.resume=true, which would fail ("no
    checkpoint to resume from"). Each offered way out is tried here."""
    outside_torchrun(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(HDETConfigError) as e:
        rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}"]))
    assert "train.resume=true" not in str(e.value) and "no checkpoint to resume from" in str(e.value)
    assert "train.overwrite=true" in str(e.value)
    assert rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", "train.overwrite=true"])) == "replace"
    # with a checkpoint the resume is offered, and works
    run_dir = _run_dir_with_a_run(tmp_path / "b")
    with pytest.raises(HDETConfigError, match="continue it with train.resume=true"):
        rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}"]))
    assert rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", "train.resume=true"])) == "resume"


def test_a_completed_run_without_a_checkpoint_is_not_said_to_have_stopped(tmp_path, monkeypatch):
    """A run that completed with train.checkpoint=false (summary.json, no checkpoint/) is
    not refused a resume "because it stopped before its first save"."""
    outside_torchrun(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "summary.json").write_text('{"checkpointed": false}')
    for extra in ([], ["train.resume=true"]):
        with pytest.raises(HDETConfigError) as e:
            rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", *extra]))
        assert "it completed with train.checkpoint=false, which saves none" in str(e.value), str(e.value)
        assert "stopped" not in str(e.value), str(e.value)
    # a run that saved, whose checkpoint/ was deleted, is not put down to
    # train.checkpoint=false; the summary says whether it saved (older ones do not: both named)
    for text, said in (('{"checkpointed": true}', f"it completed and saved a checkpoint, but {run_dir}/checkpoint "
                                                  "is gone: moved or deleted"),
                       ("{}", "not there: deleted or moved, or the run had train.checkpoint=false")):
        (run_dir / "summary.json").write_text(text)
        with pytest.raises(HDETConfigError) as e:
            rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", "train.resume=true"]))
        assert said in str(e.value) and "which saves none" not in str(e.value), str(e.value)
    (run_dir / "summary.json").unlink()  # a run stopped before its first save: said so, as before
    for extra in ([], ["train.resume=true"]):
        with pytest.raises(HDETConfigError, match="it stopped before its first save"):
            rundir.start_mode(load_run_config(None, [f"run_dir={run_dir}", *extra]))


def test_a_resume_names_the_checkpoint_and_step_it_loads(tmp_path, monkeypatch):
    """train.resume=true prints a line naming what it resumes from, as a torchrun
    restart does. The line is rank 0's first (loop.train); a fresh or replacing start of
    the user's own has none."""
    outside_torchrun(monkeypatch)
    run_dir = _run_dir_with_a_run(tmp_path)
    run = load_run_config(None, [f"run_dir={run_dir}", "train.resume=true"])
    assert rundir.restart_line(run, rundir.start_mode(run)) == (
        f"train.resume: resuming from the checkpoint checkpoint/latest names, "
        f"{run_dir / 'checkpoint' / 'replica_*' / 'global_step4'} "
        "(the state after optimizer step 4)")
    run = load_run_config(None, [f"run_dir={run_dir}", "train.overwrite=true"])
    assert rundir.restart_line(run, "replace") is None
    run = load_run_config(None, [f"run_dir={tmp_path / 'new'}"])
    assert rundir.restart_line(run, rundir.start_mode(run)) is None
    # latest pointing back to an older checkpoint: the newer one, which the resumed run's
    # saves replace, is named
    (run_dir / "checkpoint" / "hdet_layout.json").write_text(json.dumps(
        {"step": 2, "checkpoints": {"global_step2": 2, "global_step4": 4}}))
    (run_dir / "checkpoint" / "latest").write_text("global_step2")
    run = load_run_config(None, [f"run_dir={run_dir}", "train.resume=true"])
    line = rundir.restart_line(run, "resume")
    assert line.endswith("(the state after optimizer step 2); newer checkpoint(s) global_step4 (step 4) are replaced "
                         "or removed as this run saves (copy checkpoint/ first to keep them)"), line


def test_no_latest_and_an_unreadable_layout_names_the_folders_on_disk_not_only_overwrite(tmp_path):
    """``latest`` removed and ``hdet_layout.json`` emptied: the refusal names the two
    complete checkpoints still on disk, the layout to restore and the tag to write into
    latest, and says the overwrite deletes them, not only train.overwrite=true as the way
    on; with the layout missing, the same."""
    ckpt = tmp_path / "checkpoint"
    for r in range(2):
        for step in (98, 91, 7):
            (ckpt / f"replica_{r}" / f"global_step{step}").mkdir(parents=True)
    (ckpt / "hdet_layout.json").write_text("")
    msg = no_latest_message(str(ckpt))
    assert ("holds checkpoint folder(s) global_step7, global_step91, global_step98, but its hdet_layout.json, which "
            "lists the complete ones, cannot be read (damaged?)") in msg, msg
    assert f"echo global_step98 > {ckpt}/latest" in msg and "this deletes those folders" in msg, msg
    (ckpt / "hdet_layout.json").unlink()
    assert "hdet_layout.json, which lists the complete ones, is missing" in no_latest_message(str(ckpt))
    shutil.rmtree(ckpt / "replica_0")
    shutil.rmtree(ckpt / "replica_1")  # nothing on disk: only the ways to start over
    msg = no_latest_message(str(ckpt))
    assert "folder(s)" not in msg and "train.overwrite=true (removes it)" in msg, msg


def test_a_stop_after_the_final_checkpoint_before_the_summary_advises_no_refused_resume(tmp_path, monkeypatch):
    """SIGINT between the final checkpoint (step = train.steps) and summary.json does
    not say "continue with train.resume=true", which would be refused (nothing left to
    do): the line says training is done, names hdet-plot for the plots and a larger
    train.steps to train on; an earlier checkpoint keeps the resume advice."""
    import signal

    from hdet_scale.train.stopping import stop_message

    outside_torchrun(monkeypatch)
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoint"
    save(ckpt, 10)
    save(ckpt, 20)
    (run_dir / "metrics.jsonl").write_text('{"step": 20}\n')
    run = load_run_config(None, [f"run_dir={run_dir}", "train.steps=20", "train.resume=true"])
    msg = stop_message(signal.SIGINT, run, "all 2 ranks ended", 20)
    # no "a larger train.steps" where the schedule ends at train.steps (a resume would be refused)
    assert (f"global_step20 (step 20), the final one (train.steps=20): the training is done, but summary.json and "
            f"the plots were not written (hdet-plot {run_dir} draws the plots); the schedule ends there, so a resume "
            "has nothing left to train: the checkpoint holds the trained model, without the final validation "
            "loss.") in msg, msg
    longer = load_run_config(None, [f"run_dir={run_dir}", "train.steps=20", "train.resume=true",
                                    "deepspeed.hdet.schedule.total_steps=50"])
    assert ("to train on, continue with a larger train.steps (up to deepspeed.hdet.schedule.total_steps=50) and "
            "train.resume=true.") in stop_message(signal.SIGINT, longer, "all 2 ranks ended", 20)
    (ckpt / "latest").write_text("global_step10")
    assert "continue with train.resume=true and the same run_dir" in stop_message(signal.SIGINT, run, "x", 12)


def test_no_latest_whose_newest_listed_checkpoint_is_the_final_one_says_the_run_finished(tmp_path):
    """With ``latest`` removed after a finished run's final save, the advice to write its
    tag into ``latest`` would lead to "nothing is left to do": said when the newest
    listed checkpoint is at train.steps; not for an earlier one."""
    ckpt = tmp_path / "checkpoint"
    for step in (5, 10):
        for r in range(2):
            (ckpt / f"replica_{r}" / f"global_step{step}").mkdir(parents=True)
        commit(str(ckpt), {"world_size": 2, "replicas": 2, "shard_size": 1, "step": step, "total_steps": 10,
                           "backend": "ddp"}, f"global_step{step}")
    (ckpt / "latest").unlink()
    msg = no_latest_message(str(ckpt), 10)
    assert f"echo global_step10 > {ckpt}/latest" in msg, msg
    assert "That checkpoint is at train.steps=10: the run it belongs to finished its training" in msg, msg
    assert "finished its training" not in no_latest_message(str(ckpt), 20)


def test_a_save_dir_that_cannot_be_a_folder_is_named_before_any_collective(tmp_path):
    """``ens.save_checkpoint("afile")`` is no raw ``NotADirectoryError`` from
    ``os.makedirs`` on every rank: check_save_dir (run by checkpoint_target before its
    barrier) names the path and what is in the way; a folder to be made, or one there,
    passes."""
    import stat

    from hdet_scale.backends.checkpoints import check_save_dir
    from hdet_scale.errors import HDETStateError

    afile = tmp_path / "afile"
    afile.write_text("data")
    with pytest.raises(HDETStateError, match="'.*afile' is a file, not a folder"):
        check_save_dir(str(afile))
    with pytest.raises(HDETStateError, match=r"is under .*afile, which is a file"):
        check_save_dir(afile / "ckpt" / "deeper")
    check_save_dir(tmp_path / "new" / "ckpt")  # made by the save
    check_save_dir(tmp_path)
    assert afile.read_text() == "data"  # nothing touched
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            with pytest.raises(HDETStateError, match="is not writable"):
                check_save_dir(locked / "ckpt")
        finally:
            locked.chmod(stat.S_IRWXU)


def test_a_tag_never_saved_is_named_as_the_callers_not_latests(tmp_path):
    """``load_checkpoint(dir, tag="global_step3")`` (never saved; latest names
    global_step6) names the tag as the caller's, with the complete ones, not
    "<dir>/latest names 'global_step3'", blaming a file that names another tag; a latest
    that names an unlisted tag keeps its own message."""
    from hdet_scale.backends.checkpoints import check_resumable
    from hdet_scale.errors import HDETStateError

    ckpt = tmp_path / "checkpoint"
    for step in (3 * 2, 3 * 3):
        save(ckpt, step)
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp", "global_step3")
    text = str(err.value)
    assert text.startswith(f"checkpoint {ckpt} has no complete checkpoint tagged 'global_step3'"), text
    assert "global_step6 (step 6), global_step9 (step 9)" in text and f"{ckpt / 'latest'} names" not in text, text
    (ckpt / "latest").write_text("global_step3")
    with pytest.raises(HDETStateError) as err:
        check_resumable(str(ckpt), 4, REPLICAS, "ddp")
    assert str(err.value).startswith(f"{ckpt / 'latest'} names 'global_step3', which"), err.value
