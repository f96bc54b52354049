"""``hdet-plot RUN_DIR [--out DIR] [--overwrite]``: PNG plots of one ``hdet-train`` run.

Reads ``RUN_DIR/metrics.jsonl`` (``hdet_scale.logging.MetricsLogger``'s records; the x
axis is always the optimizer step) and writes into ``RUN_DIR/plots/`` (or ``--out``):

- ``fanout_<axis>_group<g>.png``: every replica's value of ``axis`` for parameter group
  ``g`` at each logged step (``hdet/<axis>/replica_<r>/group_<g>``), one line per replica;
- ``base_<axis>_group<g>.png``: the shared base value (the replicas' mean: the spread
  offsets are symmetric, ``hdet_scale.axes``) against the plain schedule, which the
  metrics do not hold: it is the base divided by the auto-LR multiplier in effect
  (``hdet/<axis>/group_<g>/multiplier`` of the last sync before the step; minus the shift
  on an additive axis, whose floor is not modelled). The title says what is shown;
- ``sync.png``: each sync's per-replica interval training loss (``hdet/loss/replica_<r>``),
  probe fitness when the run scored by a probe, and softmax weights (meta-updates only);
- ``loss.png``: the per-step training loss (``train/loss``, the mean over all ranks, which
  ``hdet-train`` logs; else rank 0's ``hdet/loss``) and the validation loss.

The trainer evaluates once, at the end, and writes that ``val_loss`` to ``summary.json``
only; a ``val/loss`` or ``val_loss`` record in ``metrics.jsonl`` is used when there is
one, else the summary's value is the one point (the only file read besides the metrics).

A plot the records cannot give (no sync yet, a single replica: no fan-out) is skipped
with one printed line; so is a value of a plotted key that is not a number (text, a list,
``1e999``), one line per key naming its first line (:func:`read_records`). Uses matplotlib's ``Figure`` directly (Agg canvas), so neither
pyplot nor the process-wide backend is touched.

The folder records whose plots it holds (``.hdet_plots.json``); another run's plots or a
user's files there are refused before anything is written (``--overwrite`` writes
anyway), and a re-plot removes the earlier PNGs it does not draw again: the rules are
``hdet_scale.plot_out``'s. Exit codes: 0 done; 2 a missing, empty or unreadable metrics
file (one ``hdet-plot: error:`` line naming it; a run_dir without one yet is said so), or
a folder that is not the plots' to write (one line naming it and what it holds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import require_regular
from hdet_scale.plot_out import PlotsFolder, claim

_VALUE = re.compile(r"^hdet/([^/]+)/replica_(\d+)/group_(\d+)$")  # one replica's axis value
_SYNC = re.compile(r"^hdet/(loss|fitness|weight)/replica_(\d+)$")  # per replica, at a sync
VAL_KEYS = ("val/loss", "val_loss")
# Every value the plots draw (series): a value of these that is not a number is skipped with a note.
_PLOTTED = re.compile(r"^(hdet/[^/]+/replica_\d+/group_\d+|hdet/(loss|fitness|weight)/replica_\d+|"
                      r"hdet/[^/]+/group_\d+/(base|multiplier)|train/loss|hdet/loss|val/loss|val_loss)$")


class _Overflowed(float):
    """A JSON number beyond float64 (``1e999``): read as inf, which no trainer writes so
    (``json_safe`` writes ``"inf"``). Shown as written."""

    text = ""

    def __repr__(self) -> str:
        return self.text


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isinf(value):
        return value
    over = _Overflowed(value)
    over.text = text
    return over


_NONFINITE_TEXT = {"nan", "inf", "-inf", "+inf", "infinity", "-infinity"}  # json_safe's str(x), and spellings


def _is_number(value: Any) -> bool:
    """What the plots can draw: a JSON number within float64, ``null`` (no loss passed)
    and the strings ``json_safe`` writes for NaN / inf; not a list, object, boolean or
    other text."""
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip().lower() in _NONFINITE_TEXT
    if isinstance(value, (bool, _Overflowed)) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:  # an integer beyond float64
        return False
    return True


def read_records(path: str, log: Callable[[str], None] | None = None) -> list[dict]:
    """The JSON records of ``path``, one per line (blank lines and a cut-off last line,
    without its newline, skipped). A value the plots draw that is not a number (a list,
    text, ``1e999``) is left out of its record, and a record whose ``step`` is not an
    integer is left out whole: ``log`` gets one line per key, naming the first line and
    how many more there are.

    Raises:
        HDETConfigError: the file is missing, unreadable, has no record, or a line is not
            a JSON object (the message names the file and line).
    """
    require_regular(path, "metrics file")  # a FIFO would block open() forever (tester round 22)
    try:
        # Bytes that are not UTF-8 become U+FFFD, so such a line is named as no JSON
        # record below, not a UnicodeDecodeError traceback (tester round 12).
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise HDETConfigError(f"{path}: cannot read the metrics file ({e.strerror or e}); "
                              "pass the run_dir of an hdet-train run") from None
    records, cut = [], None
    bad: dict[str, list] = {}  # key -> [first line, its value, how many]
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_float=_parse_float)
        except ValueError as e:
            if i == len(lines) and not line.endswith("\n"):
                cut = f"{path}:{i}: not a JSON record ({e})"
                continue  # the record a killed (or running) job was writing: the rest is whole
            raise HDETConfigError(f"{path}:{i}: not a JSON record ({e})") from None
        if not isinstance(rec, dict):
            raise HDETConfigError(f"{path}:{i}: not a JSON object")
        for key in [k for k, v in rec.items() if (k == "step" or _PLOTTED.match(k)) and not _is_number(v)
                    or k == "step" and not isinstance(v, int)]:
            bad.setdefault(key, [i, rec[key], 0])[2] += 1
            rec.pop(key)  # a record without a step is left out of every plot (series)
        records.append(rec)
    for key, (i, value, count) in bad.items():
        if log is not None:
            more = f" (and {count - 1} more such value(s) of {key})" if count > 1 else ""
            what = "is not an integer step: record skipped" if key == "step" else "is not a number: skipped"
            log(f"{path}:{i}: {key} = {repr(value)[:40]} {what}{more}")
    if not records and cut is not None and not lines[-1].lstrip().startswith("{"):
        # tester round 25: a binary file (no newline) was "no record (did the run log a step?)"
        raise HDETConfigError(f"{cut}; an hdet-train metrics file holds one JSON object per line")
    if not records:
        raise HDETConfigError(f"{path}: the metrics file holds no record (did the run log a step?)")
    return records


def _num(v: Any) -> float:
    # json_safe writes NaN / inf as strings ("nan"); hdet/loss may be null (no loss passed).
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _axis_kind(rows: list[list[float]]) -> str:
    """Multiplicative axes keep the replicas' max/min ratio, additive ones their gap,
    whatever the base does (the metrics do not name the kind; ``lr`` is always
    multiplicative). Ambiguous (a constant base, one replica): multiplicative."""
    rows = [r for r in rows if len(r) > 1 and all(math.isfinite(x) and x > 0 for x in r)]
    ratios = [max(r) / min(r) for r in rows]
    gaps = [max(r) - min(r) for r in rows]
    if not ratios or max(ratios) - min(ratios) <= 1e-6 * max(ratios):
        return "multiplicative"
    return "additive" if max(gaps) - min(gaps) <= 1e-6 * max(gaps) else "multiplicative"


def series(records: list[dict]) -> dict:
    """What the plots draw, from the records in file order (pure; the test's handle).

    Returns a dict:
        ``fanout[(axis, g)]``: ``{"steps": [s], "replicas": [[value of replica r at s]]}``
        (per-step records only; a sync record repeats its step's values);
        ``base[(axis, g)]``: ``{"steps", "base", "plain" (None: not derivable), "sync_steps",
        "sync_base" (the base each sync logged, for the next step), "shown" (title)}``;
        ``sync``: ``{"steps", "loss": [[per replica]], "fitness" (or None),
        "weight_steps", "weight": [[per replica]]}``; ``train`` and ``val``:
        ``{"steps", "loss"}``. Floats; NaN where a record lacks a value.
    """
    records = [r for r in records if isinstance(r.get("step"), int)]  # the x axis; all the trainer's have it
    steps = [r for r in records if "hdet/sync" not in r]
    syncs = [r for r in records if "hdet/sync" in r]
    out: dict[str, Any] = {"fanout": {}, "base": {}}
    cols: dict[tuple[str, int], dict[int, dict[int, float]]] = {}
    for rec in steps:
        for k, v in rec.items():
            m = _VALUE.match(k)
            if m:
                cols.setdefault((m[1], int(m[3])), {}).setdefault(rec["step"], {})[int(m[2])] = _num(v)
    for key, by_step in sorted(cols.items()):
        n = 1 + max(r for vals in by_step.values() for r in vals)
        xs = sorted(by_step)
        rows = [[by_step[s].get(r, float("nan")) for r in range(n)] for s in xs]
        out["fanout"][key] = {"steps": xs, "replicas": [[row[r] for row in rows] for r in range(n)]}
        out["base"][key] = _base(key, xs, rows, syncs)
    n_sync = 1 + max((int(m[2]) for r in syncs for m in map(_SYNC.match, r) if m), default=-1)

    def per_replica(name: str, recs: list[dict]) -> list[list[float]]:
        return [[_num(r.get(f"hdet/{name}/replica_{i}")) for r in recs] for i in range(n_sync)]

    meta = [r for r in syncs if any(k.startswith("hdet/weight/") for k in r)]
    probe = any(k.startswith("hdet/fitness/") for r in syncs for k in r)
    out["sync"] = {"steps": [r["step"] for r in syncs], "loss": per_replica("loss", syncs),
                   "fitness": per_replica("fitness", syncs) if probe else None,
                   "weight_steps": [r["step"] for r in meta], "weight": per_replica("weight", meta)}
    # hdet-train logs train/loss, the mean over all ranks; hdet/loss is rank 0's alone
    key = "train/loss" if any("train/loss" in r for r in steps) else "hdet/loss"
    train = [r for r in steps if key in r]
    out["train"] = {"steps": [r["step"] for r in train], "loss": [_num(r[key]) for r in train],
                    "key": key}
    val = [(r["step"], _num(r[k])) for r in records for k in VAL_KEYS if k in r]
    out["val"] = {"steps": [s for s, _ in val], "loss": [x for _, x in val]}
    return out


def _base(key: tuple[str, int], xs: list[int], rows: list[list[float]], syncs: list[dict]) -> dict:
    axis, g = key
    base = [sum(row) / len(row) for row in rows]
    logged = [r for r in syncs if f"hdet/{axis}/group_{g}/base" in r]
    res = {"steps": xs, "base": base, "sync_steps": [r["step"] for r in logged],
           "sync_base": [_num(r[f"hdet/{axis}/group_{g}/base"]) for r in logged]}
    mult_key = f"hdet/{axis}/group_{g}/multiplier"
    changes = [(r["step"], _num(r[mult_key])) for r in syncs if mult_key in r]
    if changes:
        kind = _axis_kind(rows)
        plain = []
        for s, b in zip(xs, base):
            # The record of step s holds the values step s ran with, set before that step's
            # sync: a sync's multiplier applies from the next step on.
            m = next((v for t, v in reversed(changes) if t < s), 1.0 if kind == "multiplicative" else 0.0)
            plain.append(b / m if kind == "multiplicative" else b - m)
        how = "base / auto-LR multiplier" if kind == "multiplicative" else "base - auto-LR shift"
        return {**res, "plain": plain, "shown": f"base (mean of replicas) vs plain schedule = {how}"}
    if any(any(k.startswith("hdet/weight/") for k in r) for r in syncs):  # controller "paper"
        return {**res, "plain": None,
                "shown": "base (mean of replicas); no multiplier logged (auto.controller paper): no plain schedule"}
    return {**res, "plain": None, "shown": "base (mean of replicas) = plain schedule (no auto-LR update ran)"}


def import_matplotlib() -> None:
    """Import matplotlib for the PNGs (``Figure.savefig``: no GUI backend is used).

    ``MPLBACKEND`` is hidden from the import: it picks an interactive backend these files
    never use, and a bad value made matplotlib's import raise ``ValueError``, failing a
    finished ``hdet-train`` run (tester round 23).

    Raises:
        ImportError: matplotlib is not installed.
        HDETConfigError: it is, but cannot start (a broken ``matplotlibrc``, an
            unwritable ``MPLCONFIGDIR``...), naming why.
    """
    saved = os.environ.pop("MPLBACKEND", None)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever its start-up raises, in one line
        raise HDETConfigError(f"matplotlib cannot start ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
                              ) from None
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved


def _figure(rows: int = 1):
    # lazily: matplotlib is the optional "plot" extra
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6 * rows), dpi=100, layout="constrained")
    return fig, [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]


def _save(fig, folder: PlotsFolder, name: str, written: list[str]) -> None:
    folder.add(name)  # in the folder's record before the file is there
    path = os.path.join(folder.path, name)
    fig.savefig(path, format="png")
    written.append(path)


def write_plots(run_dir: str, out_dir: str | None = None,
                log: Callable[[str], None] = print, overwrite: bool = False) -> list[str]:
    """Write the run's PNGs (module docstring) into ``out_dir`` (default
    ``run_dir/plots``, created) and return their paths, in writing order. ``log`` gets
    one line per skipped plot and per earlier PNG removed (``hdet_scale.plot_out``).

    Raises:
        HDETConfigError: the metrics file (:func:`read_records`); a folder that holds
            another run's plots or files that are not hdet plots (``overwrite``: written
            anyway), or that cannot be created (:func:`hdet_scale.plot_out.claim`), all
            before anything is written.
        ImportError: no matplotlib.
        OSError: a PNG or the folder's record cannot be written.
    """
    if os.path.isfile(run_dir):  # tester round 24: "<file>/metrics.jsonl: Not a directory"
        raise HDETConfigError(f"{run_dir} is a file: hdet-plot takes the run_dir that holds metrics.jsonl "
                              f"({os.path.dirname(run_dir) or '.'} here?)")
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isdir(run_dir) and not os.path.lexists(path):  # "No such file or directory" said nothing of why
        raise HDETConfigError(f"{run_dir} has no metrics.jsonl yet ({path}): a run that has not logged its first "
                              "step, or not an hdet-train run_dir")
    records = read_records(path, log)
    s = series(records)
    if not s["val"]["steps"]:
        s["val"] = _summary_val(run_dir)
    import_matplotlib()  # fail before creating the folder
    folder = claim(run_dir, out_dir, overwrite)  # another run's plots, a user's files: refused here
    folder.create()
    written: list[str] = []
    for (axis, g), f in s["fanout"].items():
        if len(f["replicas"]) < 2:
            log(f"skipped fanout_{axis}_group{g}.png: a single replica (no fan-out)")
        else:
            fig, (ax,) = _figure()
            for r, ys in enumerate(f["replicas"]):
                ax.plot(f["steps"], ys, label=f"replica {r}", lw=1.2)
            for x in s["sync"]["steps"]:
                ax.axvline(x, color="0.85", lw=0.8, zorder=0)
            ax.set(title=f"{axis}, group {g}: every replica's value (grey: syncs)", xlabel="optimizer step",
                   ylabel=axis)
            ax.legend(fontsize="small")
            _save(fig, folder, f"fanout_{axis}_group{g}.png", written)
        b = s["base"][(axis, g)]
        fig, (ax,) = _figure()
        ax.plot(b["steps"], b["base"], label="base (mean of replicas)", lw=1.5)
        if b["plain"] is not None:
            ax.plot(b["steps"], b["plain"], "--", label="plain schedule (no auto-LR)", lw=1.2)
        if b["sync_steps"]:
            ax.plot(b["sync_steps"], b["sync_base"], "o", ms=4, label="base logged at each sync (next step's)")
        ax.set_title(f"{axis}, group {g}: {b['shown']}", fontsize="small")
        ax.set(xlabel="optimizer step", ylabel=axis)
        ax.legend(fontsize="small")
        _save(fig, folder, f"base_{axis}_group{g}.png", written)
    if not s["fanout"]:
        log("skipped fanout_*.png and base_*.png: no per-replica values in the metrics")
    sy = s["sync"]
    if not sy["steps"]:
        log("skipped sync.png: no sync in the metrics yet")
    else:
        fig, (top, bottom) = _figure(2)
        for r, ys in enumerate(sy["loss"]):
            line, = top.plot(sy["steps"], ys, "o-", ms=3, label=f"replica {r}: interval train loss")
            if sy["fitness"] is not None:
                top.plot(sy["steps"], sy["fitness"][r], "s--", ms=3, color=line.get_color(),
                         label=f"replica {r}: probe fitness")
        top.set(title="fitness at each sync", xlabel="optimizer step", ylabel="loss (nats/byte)")
        top.legend(fontsize="x-small")
        for r, ys in enumerate(sy["weight"]):
            bottom.plot(sy["weight_steps"], ys, "o-", ms=3, label=f"replica {r}")
        bottom.set(title="softmax weights (meta-updates only)" if sy["weight_steps"] else
                   "softmax weights: no meta-update yet (auto-LR off or in warm-up)",
                   xlabel="optimizer step", ylabel="weight", ylim=(-0.05, 1.05))
        if sy["weight_steps"]:
            bottom.legend(fontsize="x-small")
        _save(fig, folder, "sync.png", written)
    if not s["train"]["steps"] and not s["val"]["steps"]:
        log("skipped loss.png: no loss in the metrics")
    else:
        fig, (ax,) = _figure()
        who = "mean over all ranks" if s["train"].get("key") == "train/loss" else "rank 0"
        ax.plot(s["train"]["steps"], s["train"]["loss"], lw=1, label=f"train loss ({who}, per step)")
        if s["val"]["steps"]:
            ax.plot(s["val"]["steps"], s["val"]["loss"], "o-", ms=5, label="validation loss")
        else:
            log("loss.png: no validation loss in the run (train loss only)")
        ax.set(title="loss", xlabel="optimizer step", ylabel="loss (nats/byte)")
        ax.legend(fontsize="small")
        _save(fig, folder, "loss.png", written)
    if not written:  # nothing of an hdet-train run in the file: say so, not exit 0
        raise HDETConfigError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no record of an hdet-train run in it "
                              "(no hdet/* values per step): nothing to plot")
    for path in folder.finish():
        log(f"removed {path}: an earlier plotting's, not drawn this time")
    return written


def _summary_val(run_dir: str) -> dict:
    """The trainer's one evaluation, at the end: ``summary.json``'s ``val_loss`` at its
    ``steps`` (nothing when the run has no summary yet or a diverged one, ``null``)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):  # absent, or a FIFO / device that open() would wait on
        return {"steps": [], "loss": []}
    try:
        with open(path) as f:
            summary = json.load(f)
        val, step = summary["val_loss"], summary["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return {"steps": [], "loss": []}
    return {"steps": [step], "loss": [float(val)]} if isinstance(val, (int, float)) else {"steps": [], "loss": []}


def plot_after_run(run_dir: str) -> None:
    """``hdet-train``'s end of run (rank 0): write the plots, never fail the run. Without
    matplotlib one note line; any error one warning line. Prints to stderr (stdout
    carries the summary JSON)."""
    def say(line: str) -> None:
        print(f"hdet-train: {line}", file=sys.stderr, flush=True)

    try:
        import_matplotlib()
    except HDETConfigError as e:
        say(f"warning: no plots: {e}")
        return
    except ImportError:
        say("note: no plots (matplotlib is not installed: pip install 'hdet-scale[plot]', then hdet-plot RUN_DIR)")
        return
    try:
        paths = write_plots(run_dir, log=lambda line: say(f"plot: {line}"))
        if paths:
            say(f"{len(paths)} plots in {os.path.dirname(paths[0])}")
    except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
        say(f"warning: no plots: {e}" if isinstance(e, HDETConfigError) else
            f"warning: no plots ({type(e).__name__}: {e})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hdet-plot", description="PNG plots of an hdet-train run (its metrics.jsonl).",
                                allow_abbrev=False)  # "--ou" is not "--out": the twice-check sees each
    from hdet_scale import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s (hdet_scale) {__version__}")
    p.add_argument("run_dir", help="the run's run_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots); one that holds "
                   "another run's plots or other files is refused")
    p.add_argument("--overwrite", action="store_true", help="write into --out whatever it holds: another run's "
                   "plots there are replaced (removed when not drawn again), a file of a plot's name is replaced, "
                   "other files stay")
    args = p.parse_args(argv)
    given = [a for a in (sys.argv[1:] if argv is None else argv) if a == "--out" or a.startswith("--out=")]
    if len(given) > 1 or (args.out is not None and not args.out.strip()):
        # tester round 13: argparse kept the last of two, and "" meant the default
        p.error("--out given twice" if len(given) > 1 else "--out: an empty folder name; leave --out out for "
                "RUN_DIR/plots")
    try:
        paths = write_plots(args.run_dir, args.out, overwrite=args.overwrite)
    except HDETConfigError as e:
        print(f"hdet-plot: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"hdet-plot: error: matplotlib is needed ({e}): pip install 'hdet-scale[plot]'", file=sys.stderr)
        return 2
    except OSError as e:  # a PNG that cannot be written (disk full, a folder in its place)
        print(f"hdet-plot: error: cannot write {e.filename or 'a plot'}: {e.strerror or e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
