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
import contextlib
import os
import sys
from collections.abc import Callable

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError
from hdet_scale.errors import HDETConfigError
from hdet_scale.plot_out import PlotsFolder, claim

from hdet_scale.plot_series import read_records, series
from hdet_scale.train.run_lock import holder


def import_matplotlib() -> None:
    """Import matplotlib for the PNGs (``Figure.savefig``: no GUI backend is used).

    ``MPLBACKEND`` is hidden from the import: it picks an interactive backend these files
    never use, and a bad value makes matplotlib's import raise ``ValueError``, which would
    fail a finished ``hdet-train`` run.

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


def _save(fig, folder: PlotsFolder, name: str, written: list[str], log: Callable[[str], None]) -> None:
    folder.add(name)  # in the folder's record before the file is there
    path = os.path.join(folder.path, name)
    import warnings

    with warnings.catch_warnings():
        # a loss of 1e308 prints numpy's "overflow encountered in multiply" from
        # matplotlib's tick placement; the plot is drawn all the same
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            fig.savefig(path, format="png")
        except (ValueError, OverflowError) as e:
            # losses alternating +-1e308 give matplotlib's "arange: cannot compute
            # length"; the other plots are still worth having
            with contextlib.suppress(OSError):
                os.remove(path)
            log(f"skipped {name}: matplotlib cannot draw its values ({str(e).splitlines()[0][:120]}; values near "
                "the float64 limit?)")
            return
    written.append(path)


def write_plots(run_dir: str, out_dir: str | None = None,
                log: Callable[[str], None] = print, overwrite: bool = False) -> list[str]:
    """Write the run's PNGs (module docstring) into ``out_dir`` (default
    ``run_dir/plots``, created) and return their paths, in writing order. ``run_dir`` may
    also name a JSONL file of HDET records (``hdet.logging.jsonl`` of the library or
    ``HDETTrainer``): the default folder is then ``<file without .jsonl>_plots`` beside it. ``log`` gets
    one line per skipped plot and per earlier PNG removed (``hdet_scale.plot_out``).

    Raises:
        HDETConfigError: the metrics file (:func:`read_records`); a folder that holds
            another run's plots or files that are not hdet plots (``overwrite``: written
            anyway), or that cannot be created (:func:`hdet_scale.plot_out.claim`), all
            before anything is written.
        ImportError: no matplotlib.
        OSError: a PNG or the folder's record cannot be written.
    """
    metrics = None  # a JSONL named itself: hdet.logging.jsonl of the library or HDETTrainer
    if os.path.isfile(run_dir):
        if not run_dir.endswith(".jsonl"):  # not "<file>/metrics.jsonl: Not a directory"
            raise HDETConfigError(f"{run_dir} is a file, not a .jsonl: hdet-plot takes the run_dir that holds "
                                  f"metrics.jsonl ({os.path.dirname(run_dir) or '.'} here?) or a JSONL of HDET "
                                  "records (hdet.logging.jsonl)")
        metrics, run_dir = run_dir, os.path.dirname(run_dir) or "."
        if os.path.basename(metrics) == "metrics.jsonl":
            metrics = None  # an hdet-train run_dir's own: plotted as that run_dir
    path = source = metrics or os.path.join(run_dir, "metrics.jsonl")
    if metrics is None and os.path.isdir(run_dir) and not os.path.lexists(path):
        # "No such file or directory" said nothing of why
        raise HDETConfigError(f"{run_dir} has no metrics.jsonl yet ({path}): a run that has not logged its first "
                              "step, or not an hdet-train run_dir")
    records = read_records(path, log)
    s = series(records)
    if not s["val"]["steps"] and metrics is None:
        s["val"] = _summary_val(run_dir)
    import_matplotlib()  # fail before creating the folder
    folder = claim(run_dir, out_dir, overwrite, metrics)  # another run's plots, a user's files: refused here
    existed = os.path.isdir(folder.path)
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
            _save(fig, folder, f"fanout_{axis}_group{g}.png", written, log)
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
        _save(fig, folder, f"base_{axis}_group{g}.png", written, log)
    if not s["fanout"]:
        log("skipped fanout_*.png and base_*.png: no per-replica values in the metrics")
    sy = s["sync"]
    if not sy["steps"]:
        # a run shorter than sync_interval has none (its final converge is no sync: no record)
        log("skipped sync.png: no sync record in the metrics (a sync comes every sync_interval steps)")
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
        _save(fig, folder, "sync.png", written, log)
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
        _save(fig, folder, "loss.png", written, log)
    if not written:  # nothing of an hdet-train run in the file: say so, not exit 0
        if not existed:  # and leave no empty folder made for it
            with contextlib.suppress(OSError):
                os.rmdir(folder.path)
        # the file given (a JSONL's error must not name ./metrics.jsonl)
        raise HDETConfigError(f"{source}: no record of an hdet-train run in it (no hdet/* values in records with "
                              "an integer \"step\"): nothing to plot")
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
            summary = json_load(f)
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
    p.add_argument("run_dir", help="the run's run_dir (holds metrics.jsonl), or a JSONL file of HDET records "
                   "(hdet.logging.jsonl of the library or HDETTrainer; plots go to <file>_plots beside it)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots); one that holds "
                   "another run's plots or other files is refused")
    p.add_argument("--overwrite", action="store_true", help="write into --out whatever it holds: another run's "
                   "plots there are replaced (removed when not drawn again), a file of a plot's name is replaced, "
                   "other files stay")
    args = p.parse_args(argv)
    given = [a for a in (sys.argv[1:] if argv is None else argv) if a == "--out" or a.startswith("--out=")]
    if len(given) > 1 or (args.out is not None and not args.out.strip()):
        # argparse keeps the last of two, and "" would mean the default
        p.error("--out given twice" if len(given) > 1 else "--out: an empty folder name; leave --out out for "
                "RUN_DIR/plots")
    if (training := holder(args.run_dir)) is not None:  # unsaid, such plots read as final
        print(f"hdet-plot: note: {args.run_dir} is still training (hdet-train, {training}): these plots show the "
              "steps logged so far, the validation loss comes at its end, and its end-of-run plots replace them",
              file=sys.stderr, flush=True)
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
