"""Where a run_dir is (``train/run_dir_place.py``): run_dir=/ would train and write
checkpoint/, plots/, metrics.jsonl... among the system's folders, and a folder of the
user's own files would get the run's files beside them without a word. The root is
refused (exit 2, before anything is written); a non-empty folder that holds no run gets
one note from the process that announces; an empty, new or earlier-run folder gets none.
And ``nproc=1`` (a world the user asked for) is not asked about plain ``python``."""

from __future__ import annotations

import os

import pytest

from hdet_scale.errors import HDETConfigError
from hdet_scale.train import cli, rundir
from hdet_scale.train.config import load_run_config
from hdet_scale.train.run_dir_place import foreign_files_note, refuse_root
from hdet_scale.train.start_notes import print_engine_notes

TINY = ["backend=ddp", "wandb.enabled=false", "train.progress=false", "train.steps=20", "model.num_layers=1",
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2", "model.num_kv_heads=2",
        "data.max_bytes=200000", "train.eval_batches=2", "deepspeed.hdet.sync_interval=10",
        "deepspeed.hdet.auto.warmup_steps=10"]


@pytest.fixture
def no_world(monkeypatch):
    """hdet-train's own launcher path: no RANK/WORLD_SIZE from the shell, and no rank started."""
    from hdet_scale.train import launcher

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    started = []
    monkeypatch.setattr(launcher, "launch_local", lambda run: started.append(run) or 0)
    return started


@pytest.mark.parametrize("given", ["/", "//", "/tmp/..", "link"])
def test_the_filesystem_root_is_refused_for_run_dir_and_wandb_dir(given, tmp_path):
    path = given
    if given == "link":
        path = str(tmp_path / "root_link")
        os.symlink("/", path)
    with pytest.raises(HDETConfigError, match=r"^run_dir: .* is the filesystem root.*run_dir=runs/my_run"):
        refuse_root(path)
    with pytest.raises(HDETConfigError, match=r"^wandb\.dir: .* is the filesystem root"):
        rundir.check_writable(path, key="wandb.dir")  # refused before its probe file is written
    refuse_root(str(tmp_path))  # any other folder: no word


def test_hdet_train_refuses_run_dir_root_with_exit_2_and_writes_nothing(no_world, capsys):
    before = set(os.listdir("/"))
    assert cli.main([*TINY, "nproc=2", "run_dir=/"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hdet-train: error: run_dir: / is the filesystem root"), err
    assert no_world == [] and set(os.listdir("/")) <= before  # no rank, no lock file in /


def _run(run_dir, *extra) -> dict:
    keys = {e.split("=", 1)[0] for e in extra}  # an override given twice is refused: extra replaces TINY's
    return load_run_config(None, [*(a for a in TINY if a.split("=", 1)[0] not in keys), f"run_dir={run_dir}", *extra])


def test_a_folder_of_the_users_files_gets_one_note_naming_the_count_and_what_is_written(tmp_path):
    (tmp_path / "my.yaml").write_text("a: 1\n")
    (tmp_path / "notes.txt").write_text("x\n")
    (tmp_path / "src").mkdir()
    (tmp_path / ".env").write_text("")
    (tmp_path / rundir.LOCK_FILE).write_text("")  # this start's own (the launcher holds it first): not counted
    note = foreign_files_note(_run(tmp_path))
    assert note == (f"run_dir: {tmp_path} already holds 4 entries (.env, my.yaml, notes.txt, ...) and no earlier run "
                    "of hdet-train; this run writes checkpoint/, plots/, metrics.jsonl, summary.json, .hdet_run.lock "
                    "beside them (and removes none of them): give a new or empty run_dir to keep the run's files "
                    "apart"), note
    one = tmp_path / "one"
    one.mkdir()
    (one / "cfg.yaml").write_text("")
    note = foreign_files_note(_run(one, "train.plots=false", "train.checkpoint=false", "wandb.enabled=true",
                                   "wandb.mode=offline"))
    assert "holds 1 entry (cfg.yaml)" in note and "writes metrics.jsonl, summary.json, .hdet_run.lock, wandb/ " \
           "beside it" in note, note


def test_no_note_for_a_new_an_empty_or_an_earlier_runs_folder(tmp_path):
    assert foreign_files_note(_run(tmp_path / "new")) is None
    assert foreign_files_note(_run(tmp_path)) is None
    (tmp_path / rundir.LOCK_FILE).write_text("")
    (tmp_path / rundir.JOB_FILE).write_text("{}")
    assert foreign_files_note(_run(tmp_path)) is None  # what a start itself put there
    (tmp_path / "my.yaml").write_text("")
    (tmp_path / "metrics.jsonl").write_text("")  # a run of ours: start_mode refuses or replaces it
    assert foreign_files_note(_run(tmp_path)) is None


def test_the_note_is_printed_once_at_the_start(no_world, tmp_path, capsys):
    (tmp_path / "train.yaml").write_text("train:\n  steps: 20\n")
    assert cli.main([*TINY, "nproc=2", f"run_dir={tmp_path}"]) == 0 and len(no_world) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if f"run_dir: {tmp_path} already holds" in line]
    assert len(lines) == 1 and lines[0].startswith("hdet-train: note: ") and "1 entry (train.yaml)" in lines[0], err
    print_engine_notes(_run(tmp_path / "empty"))
    assert "already holds" not in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["nproc=1"], "deepspeed.hdet.replicas: nproc=1 gives a world of 1 rank, and deepspeed.hdet.replicas=2 needs "
                  "nproc to be a multiple of 2 (nproc=2, 4, ...); or set deepspeed.hdet.replicas to one of [1]"),
    (["nproc=3"], "nproc=3 gives a world of 3 ranks, and deepspeed.hdet.replicas=2 needs nproc to be a multiple of 2"),
    (["deepspeed.hdet.replicas=3"], "nproc=4 (the default) gives a world of 4 ranks, and deepspeed.hdet.replicas=3 "
                                    "needs nproc to be a multiple of 3 (nproc=3, 6, ...); or set "
                                    "deepspeed.hdet.replicas to one of [1, 2, 4]"),
])
def test_a_world_replicas_do_not_divide_is_said_in_terms_of_nproc(no_world, tmp_path, capsys, args, needle):
    """nproc=1 (a world the user asked for) is not asked whether a script was started with
    plain python; the replicas are said in terms of nproc."""
    assert cli.main([*TINY, *args, f"run_dir={tmp_path / 'run'}"]) == 2 and no_world == []
    err = capsys.readouterr().err
    assert needle in err and "plain `python`" not in err and "allowed values for this world" not in err, err


def test_in_nproc_terms_keeps_other_errors_and_lines():
    from hdet_scale.train.validate import in_nproc_terms

    other = HDETConfigError("deepspeed.hdet.sync_interval: must be an integer >= 1")
    assert in_nproc_terms(other, 1, True) is other
    both = HDETConfigError("invalid config:\n  deepspeed.hdet.replicas: 4 replicas do not divide the world of 6 ranks; "
                           "allowed values for this world: [1, 2, 3, 6]\n  deepspeed.hdet.x: bad")
    text = str(in_nproc_terms(both, 6, True))
    assert text == ("invalid config:\n  deepspeed.hdet.replicas: nproc=6 gives a world of 6 ranks, and "
                    "deepspeed.hdet.replicas=4 needs nproc to be a multiple of 4 (nproc=4, 8, ...); or set "
                    "deepspeed.hdet.replicas to one of [1, 2, 3, 6]\n  deepspeed.hdet.x: bad"), text


def test_overwrite_notes_the_replaced_runs_wandb_folders_it_keeps(no_world, tmp_path, capsys):
    """train.overwrite=true does not keep the replaced run's offline W&B run folder
    beside the new run's without a word: one note at the start names the folder, the
    count and how to sync or delete them; none without a run to replace, without
    overwrite, or with an empty W&B folder. Nothing is removed."""
    from hdet_scale.train.run_dir_place import kept_wandb_note

    wandb_dir = tmp_path / "wandb"
    (wandb_dir / "offline-run-20261206_010101-abc").mkdir(parents=True)
    (wandb_dir / "debug.log").write_text("")
    assert kept_wandb_note(_run(tmp_path, "train.overwrite=true")) is None  # no run of ours to replace
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert kept_wandb_note(_run(tmp_path)) is None  # no overwrite: start_mode refuses
    assert kept_wandb_note(_run(tmp_path, "train.overwrite=true", "train.resume=true")) is None
    note = kept_wandb_note(_run(tmp_path, "train.overwrite=true"))
    assert note == (f"train.overwrite=true replaces the run in {tmp_path} (metrics.jsonl, summary.json, checkpoint/, "
                    f"plots/) but keeps its W&B folder {wandb_dir}: 1 run folder (offline-run-20261206_010101-abc) of "
                    f"earlier runs stays beside this run's; sync them (wandb sync {wandb_dir}/offline-run-*) or delete "
                    "them"), note
    assert cli.main([*TINY, "nproc=2", f"run_dir={tmp_path}", "train.overwrite=true"]) == 0 and len(no_world) == 1
    err = capsys.readouterr().err
    assert err.count(f"hdet-train: note: {note}") == 1, err
    assert (wandb_dir / "offline-run-20261206_010101-abc").is_dir()


def test_an_earlier_starts_wandb_folder_is_not_the_users_files(tmp_path):
    """A start stopped before its first step leaves run_dir/wandb (W&B's offline run
    folder); the restart its stop line advises must not be told the run_dir holds 1
    entry of the user's. A folder of W&B's own names is not counted; one with a file of
    the user's in it, or a file named wandb, still is."""
    wandb_dir = tmp_path / "wandb"
    (wandb_dir / "offline-run-20261206_010101-abc" / "files").mkdir(parents=True)
    (wandb_dir / "debug.log").write_text("")
    (wandb_dir / "latest-run").symlink_to(wandb_dir / "offline-run-20261206_010101-abc")
    assert foreign_files_note(_run(tmp_path, "wandb.enabled=true", "wandb.mode=offline")) is None
    (wandb_dir / "mine.txt").write_text("x")
    assert "holds 1 entry (wandb)" in foreign_files_note(_run(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    (other / "wandb").write_text("a file")
    assert "holds 1 entry (wandb)" in foreign_files_note(_run(other))
