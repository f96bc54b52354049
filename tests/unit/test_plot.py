"""hdet-plot (hdet_scale/plot.py): the series it draws equal the numbers in metrics.jsonl,
the PNGs exist, and the errors are one line naming the file (exit 2).

The synthetic metrics use the key names a real ``hdet-train`` run writes (measured: 2
replicas, ddp, auto-LR with the probe fitness, sync_interval 10)."""

import json
import os

import pytest

pytest.importorskip("matplotlib")

from hdet_scale.plot import main, series, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RHO = (0.889, 1.111)  # spread_ratio 0.111, replica r's factor (one fixed permutation here)
PLAIN = {1: 1e-3, 2: 2e-3, 3: 3e-3, 4: 2e-3, 5: 1e-3, 6: 5e-4}  # the schedule, per step
MULT = {2: 1.5, 4: 2.0, 6: 2.5}  # multiplier logged at the sync of step 2, 4, 6
LOSS = {s: 5.0 - 0.25 * s for s in PLAIN}


def _records(syncs: bool = True, val: bool = True) -> list[dict]:
    recs, m = [], 1.0
    for s in sorted(PLAIN):
        base = PLAIN[s] * m  # the values step s ran with: the last sync before s set m
        recs.append({"step": s, "hdet/loss": LOSS[s], "hdet/lr/replica_0/group_0": base * RHO[0],
                     "hdet/lr/replica_1/group_0": base * RHO[1], "train/tokens_per_s": 1000.0,
                     "train/backward_passes": s, "train/tokens_seen": 4096 * s})
        if syncs and s in MULT:
            m = MULT[s]
            recs.append({"step": s, "hdet/step": s, "hdet/sync": s // 2, "hdet/converge_s": 0.01,
                         "hdet/loss/replica_0": 4.0 + s, "hdet/loss/replica_1": 4.5 + s,
                         "hdet/fitness/replica_0": 3.0 + s, "hdet/fitness/replica_1": 3.5 + s,
                         "hdet/lr/replica_0/group_0": base * RHO[0], "hdet/lr/replica_1/group_0": base * RHO[1],
                         "hdet/temperature": 0.05, "hdet/weight/replica_0": 0.25 * s / 2,
                         "hdet/weight/replica_1": 1 - 0.25 * s / 2, "hdet/lr/group_0/multiplier": m,
                         "hdet/lr/group_0/hypergradient": 0.76, "hdet/lr/group_0/velocity": 0.38,
                         "hdet/lr/group_0/base": PLAIN[s] * m})
    if val:
        recs.append({"step": 6, "val/loss": 3.25})
    return recs


def _write(run_dir, records) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _pngs(folder) -> list[str]:
    """The folder's entries, sorted, less hdet-plot's record of whose plots it holds."""
    return sorted(n for n in os.listdir(folder) if n != ".hdet_plots.json")


def test_series_equal_the_metrics():
    s = series(_records())
    f = s["fanout"][("lr", 0)]
    assert f["steps"] == [1, 2, 3, 4, 5, 6]
    lr0 = [1e-3 * .889, 2e-3 * .889, 3e-3 * 1.5 * .889, 2e-3 * 1.5 * .889, 1e-3 * 2 * .889, 5e-4 * 2 * .889]
    assert f["replicas"][0] == pytest.approx(lr0, rel=1e-12)
    assert f["replicas"][1] == pytest.approx([x / .889 * 1.111 for x in lr0], rel=1e-12)
    b = s["base"][("lr", 0)]
    assert b["base"] == pytest.approx([1e-3, 2e-3, 4.5e-3, 3e-3, 2e-3, 1e-3], rel=1e-12)  # mean of the two
    assert b["plain"] == pytest.approx([PLAIN[k] for k in range(1, 7)], rel=1e-12)  # base / multiplier
    assert "base / auto-LR multiplier" in b["shown"]
    assert b["sync_steps"] == [2, 4, 6] and b["sync_base"] == pytest.approx([3e-3, 4e-3, 1.25e-3])
    sy = s["sync"]
    assert sy["steps"] == [2, 4, 6] and sy["weight_steps"] == [2, 4, 6]
    assert sy["loss"] == [[6.0, 8.0, 10.0], [6.5, 8.5, 10.5]]
    assert sy["fitness"] == [[5.0, 7.0, 9.0], [5.5, 7.5, 9.5]]
    assert sy["weight"] == [[0.25, 0.5, 0.75], [0.75, 0.5, 0.25]]
    assert s["train"] == {"steps": [1, 2, 3, 4, 5, 6], "loss": [4.75, 4.5, 4.25, 4.0, 3.75, 3.5],
                          "key": "hdet/loss"}
    assert s["val"] == {"steps": [6], "loss": [3.25]}
    # hdet-train's train/loss (the mean over all ranks) is preferred to rank 0's hdet/loss
    recs = _records()
    for r in recs:
        if "hdet/loss" in r:
            r["train/loss"] = r["hdet/loss"] + 0.5
    assert series(recs)["train"] == {"steps": [1, 2, 3, 4, 5, 6], "loss": [5.25, 5.0, 4.75, 4.5, 4.25, 4.0],
                                     "key": "train/loss"}


def test_the_fanout_takes_sync_records_where_logging_every_left_no_step_record():
    """With logging.every > 1 the fan-out is drawn from the sync records too, not from
    the per-step records alone: every sync record holds the values its step ran with.
    Keep the per-step records of steps 3 and 6 only (every = 3): the fan-out is at steps
    2, 3, 4, 6 (syncs 2 and 4 from their sync records), with the values of the full
    run."""
    full = series(_records())["fanout"][("lr", 0)]
    thin = [r for r in _records() if "hdet/sync" in r or r.get("step") in (3, 6) or "val/loss" in r]
    f = series(thin)["fanout"][("lr", 0)]
    assert f["steps"] == [2, 3, 4, 6]
    for r in range(2):
        assert f["replicas"][r] == [full["replicas"][r][s - 1] for s in (2, 3, 4, 6)]


def test_nan_and_no_auto_update():
    recs = _records(syncs=False, val=False)
    recs[2]["hdet/loss"] = "nan"  # json_safe's form of a diverged step
    s = series(recs)
    assert s["train"]["loss"][2] != s["train"]["loss"][2]  # NaN
    b = s["base"][("lr", 0)]
    assert b["plain"] is None and "no auto-LR update ran" in b["shown"]
    assert s["sync"]["steps"] == [] and s["val"]["steps"] == []


def test_an_axis_outside_auto_lr_is_its_plain_schedule_and_paper_is_named():
    """An axis that auto-LR does not adjust (weight_decay here, beside an auto-LR'd lr)
    under the "log" controller is titled as its plain schedule, not "no multiplier logged
    (auto.controller paper)"; "paper" (no multiplier for any axis) keeps its own title."""
    recs = _records()
    for r in recs:
        if "hdet/lr/replica_0/group_0" in r:
            r["hdet/weight_decay/replica_0/group_0"], r["hdet/weight_decay/replica_1/group_0"] = 0.05, 0.15
    wd = series(recs)["base"][("weight_decay", 0)]
    assert wd["plain"] is None and wd["base"] == pytest.approx([0.1] * 6)
    assert wd["shown"] == "base (mean of replicas) = plain schedule (not under auto-LR)"
    for r in recs:  # the paper controller: weights, and no multiplier for any axis
        for k in [k for k in r if k.endswith("/multiplier")]:
            del r[k]
    assert series(recs)["base"][("weight_decay", 0)]["shown"] == (
        "base (mean of replicas); auto.controller paper logs no multiplier")


def test_write_plots_writes_valid_pngs(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run, _records())
    paths = write_plots(str(run))
    names = ["fanout_lr_group0.png", "base_lr_group0.png", "sync.png", "loss.png"]
    assert paths == [str(run / "plots" / n) for n in names]
    assert sorted(_pngs(run / "plots")) == sorted(names)  # nothing else in plots/ (but the record of whose)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC
    assert "skipped" not in capsys.readouterr().out


def test_no_sync_single_replica_val_from_summary(tmp_path, capsys):
    run = tmp_path / "run"
    recs = [{k: v for k, v in r.items() if "replica_1" not in k} for r in _records(syncs=False, val=False)]
    _write(run, recs)
    with open(run / "summary.json", "w") as f:
        json.dump({"val_loss": 3.5, "steps": 6}, f)
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out)]) == 0
    assert _pngs(out) == ["base_lr_group0.png", "loss.png"]
    printed = capsys.readouterr().out
    assert "skipped sync.png" in printed and "skipped fanout_lr_group0.png" in printed
    assert not (run / "plots").exists()


def test_cut_off_last_line_is_skipped(tmp_path):
    _write(tmp_path, _records())
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "hdet/lo')  # a killed run's record, half written
    assert len(write_plots(str(tmp_path))) == 4


@pytest.mark.parametrize("content", [None, "", "{not json\n", '{"step": 1}\n[1]\n',
                                     b"\x80\x90\xff binary, not UTF-8\n"])  # no UnicodeDecodeError
def test_bad_metrics_file_exits_2(tmp_path, capsys, content):
    if isinstance(content, bytes):
        (tmp_path / "metrics.jsonl").write_bytes(content)
    elif content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hdet-plot: error: ") and str(tmp_path / "metrics.jsonl") in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "plots").exists()


def test_a_file_where_the_plots_folder_goes_is_named(tmp_path, capsys):
    """A ``plots`` file in the run_dir (the user's): exit 2, one line naming it, the file
    untouched (no FileExistsError traceback)."""
    from hdet_scale.plot import main

    _write(tmp_path, _records())
    (tmp_path / "plots").write_text("mine")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hdet-plot: error: {tmp_path / 'plots'}: cannot create the plots folder") and \
        "a file or broken link is in its place" in err and "Traceback" not in err, err
    assert (tmp_path / "plots").read_text() == "mine"


def test_a_metrics_file_of_no_hdet_run_is_an_error(tmp_path, capsys):
    """Records with no hdet value are an error (exit 2), not a run of no PNG and exit 0;
    no empty plots/ is left behind."""
    from hdet_scale.plot import main

    _write(tmp_path, [{"foo": 1}, {"step": 2, "bar": 3}])
    assert main([str(tmp_path)]) == 2
    assert "no record of an hdet-train run in it" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()  # no empty plots/ left behind
    (tmp_path / "plots").mkdir()  # a folder that was there stays
    assert main([str(tmp_path)]) == 2
    assert (tmp_path / "plots").is_dir()


def test_a_run_dir_without_metrics_yet_says_so(tmp_path, capsys):
    """The run_dir of a job that has not logged its first step is not "cannot read the
    metrics file (No such file or directory)"."""
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"hdet-plot: error: {tmp_path} has no metrics.jsonl yet "
                                       f"({tmp_path / 'metrics.jsonl'}): a run that has not logged its first step, "
                                       "or not an hdet-train run_dir\n")


def test_values_that_are_not_numbers_are_skipped_with_one_note_per_key(tmp_path, capsys):
    """Text, a list, 1e999 (inf to json) and a text step are not drawn as NaN or dropped
    with exit 0 without a word: each key is named once, with the line of its first bad
    value; the values the trainer writes ("nan", null) pass."""
    from hdet_scale.plot import read_records

    recs = _records()
    recs[0]["hdet/loss"] = [1]
    recs[1]["hdet/loss"] = "x"
    recs[2]["hdet/loss"] = "nan"  # json_safe's NaN
    recs[3]["hdet/lr/replica_0/group_0"] = True
    _write(tmp_path, recs)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": "x", "hdet/loss": 1.0}\n{"step": 9, "hdet/loss": 1e999}\n{"step": 10, "hdet/loss": null}\n')
    n = len(recs)
    assert main([str(tmp_path)]) == 0
    path = tmp_path / "metrics.jsonl"
    notes = [line for line in capsys.readouterr().out.splitlines() if not line.endswith(".png")]
    assert notes == [f"{path}:1: hdet/loss = [1] is not a number: skipped (and 2 more such value(s) of hdet/loss)",
                     f"{path}:4: hdet/lr/replica_0/group_0 = True is not a number: skipped",
                     f"{path}:{n + 1}: step = 'x' is not an integer step: record skipped"]
    s = series(read_records(str(path)))
    assert s["train"]["steps"] == [3, 4, 5, 6, 10]  # steps 1, 2, 9: no loss left; the text step: no record
    assert s["fanout"][("lr", 0)]["replicas"][0][2] != s["fanout"][("lr", 0)]["replicas"][0][2]  # step 3's: NaN


def test_values_out_of_step_order_are_skipped_with_a_note(tmp_path, capsys):
    """A record appended at step 3 after step 30, and a repeated step 30, are not drawn
    without a word (the curve running back to step 3): a value at a step before the last
    one of its key, or at the same step again, is skipped with one note per key; a
    replica's axis value, which the trainer logs twice at a sync step, may repeat its
    step."""
    from hdet_scale.plot import read_records

    recs = _records()
    last = recs[-2]["step"]  # the last training step (the val record follows)
    _write(tmp_path, recs + [{"step": 3, "hdet/loss": 2.5}, {"step": last, "hdet/loss": 9.0},
                             {"step": 2, "hdet/lr/replica_0/group_0": 1.0}])
    path = tmp_path / "metrics.jsonl"
    assert main([str(tmp_path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if not line.endswith(".png")]
    n = len(recs)
    assert notes == [f"{path}:{n + 1}: hdet/loss at step 3, not after step {last} where it was logged before: skipped, "
                     "the records are out of step order (lines appended from another run?) (and 1 more such value(s) "
                     "of hdet/loss)",
                     f"{path}:{n + 3}: hdet/lr/replica_0/group_0 at step 2, not after step {last} where it was "
                     "logged before: skipped, the records are out of step order (lines appended from another run?)"]
    s = series(read_records(str(path)))
    assert s["train"]["steps"] == sorted(s["train"]["steps"]) and 9.0 not in s["train"]["loss"]
    _write(tmp_path, recs)  # the trainer's own file: no note
    assert main([str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if not line.endswith(".png")] == []


def test_a_fifo_is_refused_not_waited_on(tmp_path, capsys):
    """``hdet-plot`` on a run_dir whose ``metrics.jsonl`` is a FIFO does not print
    nothing and block in open() until killed (hdet-train refuses FIFOs): exit 2 naming
    the file; a FIFO ``summary.json`` is skipped like a missing one. Run in a thread so
    that a regression fails here instead of hanging the suite."""
    import threading

    def run(argv, out):
        t = threading.Thread(target=lambda: out.append(main(argv)), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"hdet-plot {argv} still blocked after 30 s"
        return out[0]

    fifo_run = tmp_path / "fifo"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "metrics.jsonl")
    assert run([str(fifo_run)], []) == 2
    assert "metrics.jsonl' is not a regular file but a FIFO" in capsys.readouterr().err
    good = tmp_path / "good"
    _write(good, _records())
    os.mkfifo(good / "summary.json")
    assert run([str(good), "--out", str(tmp_path / "out")], []) == 0
    assert "loss.png" in os.listdir(tmp_path / "out")


def test_a_bad_mplbackend_neither_fails_the_run_nor_the_command(tmp_path):
    """``MPLBACKEND=nonsense`` makes matplotlib's import raise ValueError, which would end
    a finished ``hdet-train`` run with a traceback and exit 1 (docs: a plot never fails a
    run), and ``hdet-plot`` with a traceback. The PNGs use no GUI backend, so the variable
    is hidden from the import: both write their plots. A fresh interpreter, as this one
    may have imported matplotlib already."""
    import subprocess
    import sys

    run = tmp_path / "run"
    _write(run, _records())
    env = {**os.environ, "MPLBACKEND": "nonsense"}
    code = ("import sys; from hdet_scale.plot import plot_after_run, main; plot_after_run(sys.argv[1]); "
            "sys.exit(main([sys.argv[1], '--out', sys.argv[2]]))")
    proc = subprocess.run([sys.executable, "-c", code, str(run), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "hdet-train: 4 plots in" in proc.stderr, proc.stderr
    assert sorted(os.listdir(run / "plots")) == sorted(os.listdir(tmp_path / "out")) != []


def test_a_metrics_file_is_plotted_as_its_run_and_a_library_jsonl_beside_itself(tmp_path, capsys):
    """``hdet-plot RUN/metrics.jsonl`` plots as ``RUN`` (the same PNGs, into RUN/plots),
    not "RUN/metrics.jsonl/metrics.jsonl: cannot read the metrics file (Not a directory)";
    a library or HDETTrainer ``hdet.logging.jsonl`` plots too: ``logs/hdet.jsonl`` into
    ``logs/hdet_plots``, the same PNG names as a run_dir of the same records, and again on
    a second call (its own earlier plots); a file that is no .jsonl keeps its error."""
    run = tmp_path / "run"
    _write(run, _records())
    assert main([str(run / "metrics.jsonl")]) == 0
    drawn = sorted(os.listdir(run / "plots"))
    assert drawn and all(n.endswith(".png") or n.startswith(".") for n in drawn)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "hdet.jsonl").write_text((run / "metrics.jsonl").read_text())
    (logs / "notes.txt").write_text("mine")
    (logs / "one.jsonl").write_text('{"hdet/step": 1, "hdet/loss": 1.0}\n')  # no "step": nothing to draw
    assert main([str(logs / "one.jsonl")]) == 2
    assert f"{logs / 'one.jsonl'}: no record of an hdet-train run in it (no hdet/* values in records with an " \
           'integer "step")' in capsys.readouterr().err  # the file given, not ./metrics.jsonl
    for _ in range(2):
        assert main([str(logs / "hdet.jsonl")]) == 0, capsys.readouterr().err
        assert sorted(os.listdir(logs / "hdet_plots")) == drawn
    assert (logs / "notes.txt").read_text() == "mine"
    (run / "notes.txt").write_text("x")
    capsys.readouterr()
    assert main([str(run / "notes.txt")]) == 2
    assert f"{run / 'notes.txt'} is a file, not a .jsonl: hdet-plot takes the run_dir that holds metrics.jsonl " \
           f"({run} here?)" in capsys.readouterr().err


def test_a_binary_metrics_file_is_named_as_not_json_lines(tmp_path):
    """A binary ``metrics.jsonl`` (no newline) is said as what it is, not read as a run
    cut off while writing its first record ("holds no record (did the run log a
    step?)"); a real cut-off first record keeps that message."""
    from hdet_scale.errors import HDETConfigError
    from hdet_scale.plot import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(bytes(range(14, 256)) * 4)  # no line break ("\n" 10, "\r" 13) in it
    with pytest.raises(HDETConfigError, match=r"metrics.jsonl:1: not a JSON record .*; an hdet-train metrics file "
                                              r"holds one JSON object per line"):
        read_records(str(path))
    path.write_text('{"step": 1, "hdet/lo')
    with pytest.raises(HDETConfigError, match=r"holds no record \(did the run log a step\?\)"):
        read_records(str(path))
    # a cut-off last line after whole records is left out with a note
    path.write_text('{"step": 1, "hdet/loss": 2.0}\n{"step": 2, "hdet/lo')
    notes: list[str] = []
    assert read_records(str(path), notes.append) == [{"step": 1, "hdet/loss": 2.0}]
    assert notes == [f"{path}:2: the last line is cut short (the record a stopped or running job was writing): left "
                     "out"], notes


# --- the folder the PNGs go to (hdet_scale/plot_out.py): never another run's plots, never a user's files ---

RECORD = ".hdet_plots.json"
ALL4 = ["base_lr_group0.png", "fanout_lr_group0.png", "loss.png", "sync.png"]


def _one_replica() -> list[dict]:
    """A run whose metrics give base_lr_group0.png and loss.png only (no sync, one replica)."""
    return [{k: v for k, v in r.items() if "replica_1" not in k} for r in _records(syncs=False, val=False)]


def _snapshot(folder) -> dict:
    return {n: (folder / n).read_bytes() for n in os.listdir(folder)}


def _record(folder) -> dict:
    with open(folder / RECORD) as f:
        return json.load(f)


def _one_line(capsys, folder) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"hdet-plot: error: {folder}: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def test_another_runs_plots_folder_is_refused_and_left_as_it_was(tmp_path, capsys):
    """``hdet-plot p/onlyline --out runs/f1/plots`` would replace f1's loss.png, fanout
    and base PNGs, leaving f1's sync.png: a folder of two runs' figures, f1's lost
    without a word. Exit 2 before anything is written, one line naming the folder, the
    run whose plots it holds and the way out; also for the plots of a run made before
    hdet-plot recorded whose plots a folder holds (PNGs, no record)."""
    a, b = tmp_path / "f1", tmp_path / "onlyline"
    _write(a, _records())
    _write(b, _one_replica())
    write_plots(str(a), log=lambda line: None)
    for old in (False, True):
        if old:  # f1 plotted before the record existed
            assert _record(a / "plots")["metrics"] == os.path.realpath(a / "metrics.jsonl")
            (a / "plots" / RECORD).unlink()
        before = _snapshot(a / "plots")
        assert main([str(b), "--out", str(a / "plots")]) == 2
        err = _one_line(capsys, a / "plots")
        assert f"the plots of run {os.path.realpath(a)}" in err and "another --out" in err and "--overwrite" in err
        assert _snapshot(a / "plots") == before  # byte for byte, nothing added or removed
    # a user's file beside the plots (recorded, as the trainer writes them) is not counted
    # as one of them
    write_plots(str(a), log=lambda line: None)
    (a / "plots" / "notes.txt").write_text("my notes")
    assert main([str(b), "--out", str(a / "plots")]) == 2
    err = _one_line(capsys, a / "plots")
    pngs = sorted(n for n in os.listdir(a / "plots") if n.endswith(".png"))
    assert f"({len(pngs)} plot(s): " in err and "; and 1 other file(s): notes.txt)" in err, err
    assert capsys.readouterr().out == ""


def test_a_folder_of_other_files_is_refused_and_untouched(tmp_path, capsys):
    """``hdet-plot X --out mydata`` does not write PNGs among a user's data files without a word."""
    run, data = tmp_path / "run", tmp_path / "mydata"
    _write(run, _records())
    data.mkdir()
    (data / "x.csv").write_text("1,2\n")
    (data / "loss.png").write_bytes(b"the user's figure")
    before = _snapshot(data)
    assert main([str(run), "--out", str(data)]) == 2
    err = _one_line(capsys, data)
    assert "not hdet plots" in err and "x.csv" in err and "another --out" in err
    assert _snapshot(data) == before
    (data / "x.csv").unlink()  # the user's loss.png alone: not said to be hdet's
    before = _snapshot(data)
    assert main([str(run), "--out", str(data)]) == 2
    err = _one_line(capsys, data)
    assert "PNG(s) with hdet plot names but no .hdet_plots.json saying which run made them (1 file(s): loss.png)" in err
    assert "hdet plots of" not in err and "cannot tell are its own" in err and "--overwrite" in err, err
    assert _snapshot(data) == before
    assert main([str(run), "--out", str(run)]) == 2  # the run_dir itself: metrics.jsonl is no plot
    assert "metrics.jsonl" in _one_line(capsys, run)
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]


def test_a_new_or_empty_folder_is_written_and_can_be_written_again(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run, _records())
    empty, new = tmp_path / "empty", tmp_path / "new" / "deeper"
    empty.mkdir()
    for out in (empty, new, new):  # the third: the folder holds this run's plots now
        assert main([str(run), "--out", str(out)]) == 0
        assert _pngs(out) == ALL4
        record = _record(out)
        assert record["metrics"] == os.path.realpath(run / "metrics.jsonl") and sorted(record["pngs"]) == ALL4
    assert capsys.readouterr().err == ""


def test_replotting_removes_the_earlier_plots_it_does_not_write_again(tmp_path):
    """A folder never mixes two plottings: a PNG of the earlier one that this one does not
    write (the metrics give no sync, one replica, now) goes; every other file stays."""
    run, out = tmp_path / "run", tmp_path / "out"
    _write(run, _records())
    assert main([str(run)]) == 0 and main([str(run), "--out", str(out)]) == 0
    (run / "plots" / "notes.txt").write_text("mine")
    (out / "notes.txt").write_text("mine")
    (out / "base_mine.png").write_bytes(b"mine, not in the record")  # the record lists what hdet-plot wrote
    before = _snapshot(run / "plots")
    _write(run, _one_replica())
    for argv, folder in (([str(run)], run / "plots"), ([str(run), "--out", str(out)], out)):
        assert main(argv) == 0
        kept = ["base_mine.png"] if folder == out else []
        assert _pngs(folder) == sorted(["base_lr_group0.png", "loss.png", "notes.txt", *kept])
        assert sorted(_record(folder)["pngs"]) == ["base_lr_group0.png", "loss.png"]
        assert (folder / "notes.txt").read_text() == "mine"
    after = _snapshot(run / "plots")
    assert after["base_lr_group0.png"] != before["base_lr_group0.png"] and after["loss.png"] != before["loss.png"]
    assert (out / "base_mine.png").read_bytes() == b"mine, not in the record"


def test_a_run_plotted_before_the_record_existed_is_plotted_again(tmp_path, capsys):
    """``hdet-plot runs/default`` keeps working for a run whose plots/ has PNGs and no
    record (as an hdet-train that wrote no record left them): its own folder is always its to
    write; an hdet-plot PNG this plotting does not write again goes, a user's file stays."""
    run = tmp_path / "run"
    _write(run, _records())
    write_plots(str(run), log=lambda line: None)
    (run / "plots" / RECORD).unlink()
    (run / "plots" / "fanout_weight_decay_group0.png").write_bytes(b"an earlier plotting's")
    (run / "plots" / "mine.txt").write_text("the user's")
    for argv in ([str(run)], [str(run), "--out", str(run / "plots")]):  # the same folder, named or not
        assert main(argv) == 0
        assert _pngs(run / "plots") == sorted([*ALL4, "mine.txt"])
        assert _record(run / "plots")["metrics"] == os.path.realpath(run / "metrics.jsonl")
        (run / "plots" / RECORD).unlink()
    assert capsys.readouterr().err == ""


def test_overwrite_replaces_another_runs_plots_and_the_run_takes_its_folder_back(tmp_path, capsys):
    """``--overwrite``: the way out the refusal names. The folder then holds the new run's
    plots only (the other run's PNGs go, the user's files stay); ``hdet-train``'s end of
    run (``plot_after_run``) always writes into its own run_dir/plots, whoever's they hold."""
    from hdet_scale.plot import plot_after_run

    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, _records())
    _write(b, _one_replica())
    write_plots(str(a), log=lambda line: None)
    (a / "plots" / "mine.txt").write_text("the user's")
    assert main([str(b), "--out", str(a / "plots"), "--overwrite"]) == 0
    assert _pngs(a / "plots") == ["base_lr_group0.png", "loss.png", "mine.txt"]
    assert _record(a / "plots")["metrics"] == os.path.realpath(b / "metrics.jsonl")
    plot_after_run(str(a))
    assert "4 plots in" in capsys.readouterr().err
    assert _pngs(a / "plots") == sorted([*ALL4, "mine.txt"])
    assert _record(a / "plots")["metrics"] == os.path.realpath(a / "metrics.jsonl")
    data = tmp_path / "data"
    data.mkdir()
    (data / "x.csv").write_text("1\n")
    (data / "base_rates.png").write_bytes(b"the user's")
    assert main([str(b), "--out", str(data), "--overwrite"]) == 0  # asked for: written among the user's files
    assert _pngs(data) == ["base_lr_group0.png", "base_rates.png", "loss.png", "x.csv"]
    assert (data / "base_rates.png").read_bytes() == b"the user's"


def test_train_overwrite_removes_the_plots_and_their_record_but_not_a_users_file(tmp_path):
    """``train.overwrite=true`` removes the replaced run's PNGs from run_dir/plots: the
    record of whose plots they were goes with them (left, it would keep the emptied folder alive), a
    user's own file there stays, and so does the folder then."""
    from hdet_scale.plot_out import RECORD
    from hdet_scale.train.rundir import _remove_plots

    for keep in (False, True):
        run = tmp_path / f"run{int(keep)}"
        _write(run, _records())
        write_plots(str(run), log=lambda line: None)
        assert (run / "plots" / RECORD).exists() and _pngs(run / "plots")
        if keep:
            (run / "plots" / "my_figure.png").write_bytes(b"mine")
        _remove_plots(str(run))
        if keep:
            assert sorted(os.listdir(run / "plots")) == ["my_figure.png"]
        else:
            assert not (run / "plots").exists()


def test_values_matplotlib_cannot_draw_skip_that_plot_with_a_note(tmp_path, capsys):
    """Train losses alternating +-1e308 (matplotlib's "arange: cannot compute length")
    skip that plot with one line naming it, not a traceback; the others are written,
    exit 0, no partial file left."""
    recs = _records()
    for i, r in enumerate(recs):
        if "hdet/loss" in r:
            r["hdet/loss"] = 1e308 if i % 2 else -1e308
    _write(tmp_path, recs)
    out = tmp_path / "out"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped loss.png: matplotlib cannot draw its values (arange: cannot compute length" in printed, printed
    assert "Traceback" not in printed and not (out / "loss.png").exists()
    assert _pngs(out) == ["base_lr_group0.png", "fanout_lr_group0.png", "sync.png"]


def test_a_file_whose_steps_are_all_floats_says_so(tmp_path, capsys):
    """Every record's step a float (1.5, 2.5...) is skipped with a note, and the error
    then names the steps, not only "no record of an hdet-train run in it", which the
    file is."""
    recs = _records()
    for r in recs:
        r["step"] = r["step"] + 0.5
    _write(tmp_path, recs)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no record has an integer step (the values of step above were skipped)" in err, err
    assert "no record of an hdet-train run" not in err


def test_plots_of_a_run_still_training_say_so(tmp_path, capsys):
    """hdet-plot on a run still training does not say "no validation loss in the run" as
    if it were done: with the run's lock held (as a running hdet-train holds it) one note
    says the run is still training; without it, none."""
    import fcntl

    _write(tmp_path, _records())
    fd = os.open(tmp_path / ".hdet_run.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"pid 123 on host, since 2026-12-05 09:00:00\n")
        assert main([str(tmp_path)]) == 0
        err = capsys.readouterr().err
        assert (f"hdet-plot: note: {tmp_path} is still training (hdet-train, pid 123 on host, since 2026-12-05 "
                "09:00:00): these plots show the steps logged so far") in err, err
    finally:
        os.close(fd)
    assert main([str(tmp_path)]) == 0
    assert "still training" not in capsys.readouterr().err
