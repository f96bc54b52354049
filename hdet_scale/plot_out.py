"""The folder ``hdet-plot`` writes its PNGs into, and the record of whose plots it holds.

Next to the PNGs, :data:`RECORD` (``.hdet_plots.json``) names the real path of the
``metrics.jsonl`` they were drawn from and the PNGs written. :func:`claim` allows writing
into a folder that

- does not exist yet, or is empty;
- is the run's own ``run_dir/plots`` (named or not, compared by real path), whatever it
  holds: a run plotted before the record existed has PNGs and no record, and a copied or
  moved run_dir's record names the metrics where they were;
- holds a record naming the same metrics file (this run's earlier plots);
- or anything, with ``--overwrite``.

Anything else (another run's plots, a user's files, the run_dir itself) is refused before
a file is written: :class:`HDETConfigError`, one line naming the folder, what it holds and
the way out (else ``hdet-plot p/onlyline --out runs/f1/plots`` would replace f1's PNGs but
sync.png, leaving the figures of two runs, and ``--out mydata`` write among a user's files).

A folder never mixes two plottings: :meth:`PlotsFolder.finish` removes the earlier PNGs
that this plotting did not write again, those the record listed, and in a run's
``run_dir/plots`` also every file named as hdet-plot names its PNGs (:data:`PLOT_NAME`,
the names ``train.overwrite`` removes there). Nothing else is ever removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

from hdet_scale.safe_parse import json_loads  # deep nesting is a ValueError
from hdet_scale.errors import HDETConfigError

RECORD = ".hdet_plots.json"
#: The names hdet-plot gives its PNGs (as ``hdet_scale.train.rundir`` removes them).
PLOT_NAME = re.compile(r"(fanout_.+|base_.+|sync|loss)\.png")
_TEMP = re.compile(re.escape(RECORD) + r"\.tmp\d+")  # a record being written (or left by a killed write)
_UNREADABLE = {"metrics": None, "pngs": set()}


def _is_plot_name(name: str) -> bool:
    return os.path.basename(name) == name and "\0" not in name and bool(PLOT_NAME.fullmatch(name))


def _shown(text: str) -> str:
    return text if text.isprintable() else ascii(text)


def _listing(names: list[str], most: int = 4) -> str:
    names = sorted(names)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(_shown(n) for n in names[:most]) + more


def plot_files(folder: str) -> list[str]:
    """The names in ``folder`` that hdet-plot gives its PNGs (:data:`PLOT_NAME`), sorted;
    ``[]`` when it is not a folder or cannot be listed. Raises nothing."""
    try:
        return sorted(n for n in os.listdir(folder) if _is_plot_name(n))
    except OSError:
        return []


def read_record(folder: str) -> dict | None:
    """``folder``'s record: ``{"metrics": real path or None (unreadable), "pngs": set of
    PNG names}`` (a listed name that hdet-plot does not give its PNGs is dropped), or
    ``None`` without one. Raises nothing."""
    path = os.path.join(folder, RECORD)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):  # a folder, a FIFO (open would wait), a broken link
        return _UNREADABLE
    try:
        with open(path, encoding="utf-8") as f:
            rec = json_loads(f.read(1 << 20))
    except (OSError, ValueError):
        return _UNREADABLE
    if not isinstance(rec, dict) or not isinstance(rec.get("metrics"), str) or not isinstance(rec.get("pngs"), list):
        return _UNREADABLE
    return {"metrics": rec["metrics"], "pngs": {n for n in rec["pngs"] if isinstance(n, str) and _is_plot_name(n)}}


def plotted_since(folder: str, since: float) -> bool:
    """Whether a plotting finished in ``folder`` at or after ``since`` (``time.time()``,
    with 2 s for the kernel's coarse file clock): its record says complete and is that
    new. A folder of PNGs without a record (an older hdet-plot) counts when one PNG is
    that new. Raises nothing."""
    try:
        path = os.path.join(folder, RECORD)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                rec = json_loads(f.read(1 << 20))
            return (isinstance(rec, dict) and rec.get("complete") is True
                    and os.stat(path).st_mtime >= since - 2.0)
        return any(e.name.endswith(".png") and e.stat().st_mtime >= since - 2.0 for e in os.scandir(folder))
    except (OSError, ValueError):
        return False


def _run_of(folder: str) -> str | None:
    """The run_dir whose ``plots`` folder ``folder`` is (its parent holds metrics.jsonl)."""
    real = os.path.realpath(folder)
    parent = os.path.dirname(real)
    if os.path.basename(real) == "plots" and os.path.lexists(os.path.join(parent, "metrics.jsonl")):
        return parent
    return None


class PlotsFolder:
    """The folder one plotting writes into (from :func:`claim`): :meth:`create` it,
    :meth:`add` each PNG's name before writing it, :meth:`finish` after the last."""

    def __init__(self, path: str, run_dir: str, metrics: str, earlier: set[str], record: dict | None) -> None:
        self.path, self.run_dir, self.metrics = path, run_dir, metrics
        self.earlier = earlier  # earlier plottings' PNGs here: removed by finish unless written again
        self.written: list[str] = []
        # what the record on disk lists for these metrics (None: it names no such list yet)
        self._recorded = set(record["pngs"]) if record is not None and record["metrics"] == metrics else None

    def create(self) -> None:
        """Make the folder (and its parents) when it does not exist.

        Raises:
            HDETConfigError: it cannot be (a file in its place, a read-only disk), naming
                it and the way out.
        """
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:  # a file of that name, a read-only disk: the user's, named
            there = os.path.lexists(self.path) and not os.path.isdir(self.path)
            fix = ("a file or broken link is in its place: move it away, or write the plots elsewhere with "
                   f"hdet-plot {self.run_dir} --out DIR" if there else "choose a folder that can be created")
            raise HDETConfigError(f"{self.path}: cannot create the plots folder ({e.strerror or e}); {fix}") from None

    def add(self, name: str) -> None:
        """Record ``name`` before its PNG is written, so that the record always lists every
        PNG here of this plotting and of the earlier ones not yet removed (a plotting that
        stops half-way leaves none unaccounted for).

        Raises:
            OSError: the record cannot be written.
        """
        self.written.append(name)
        if self._recorded is None or name not in self._recorded:
            self._recorded = self.earlier | set(self.written)
            self._write_record([*self.written, *sorted(self.earlier - set(self.written))])

    def finish(self) -> list[str]:
        """After the last PNG: remove the earlier PNGs this plotting did not write again
        (and a record's temp file a killed write left), then record this plotting's PNGs
        alone. Returns the paths removed.

        Raises:
            OSError: the record cannot be written (a PNG that cannot be removed stays
                listed in it, and is removed by a later plotting).
        """
        removed, kept = [], []
        for name in sorted(self.earlier - set(self.written)):
            path = os.path.join(self.path, name)
            try:
                if os.path.isfile(path) or os.path.islink(path):  # never a folder of that name
                    os.remove(path)
                    removed.append(path)
            except OSError:
                kept.append(name)
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path):
                if _TEMP.fullmatch(name) and name != f"{RECORD}.tmp{os.getpid()}":
                    os.remove(os.path.join(self.path, name))
        self._write_record([*self.written, *kept], complete=True)
        return removed

    def _write_record(self, names: list[str], complete: bool = False) -> None:
        path = os.path.join(self.path, RECORD)
        tmp = f"{path}.tmp{os.getpid()}"
        # "complete": written by finish() alone, after the last PNG (a stop during the
        # end-of-run plots can then say they were not all written)
        record = {"metrics": self.metrics, "pngs": names, "complete": complete}
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, path)  # a reader sees the old record or the new one
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise


def claim(run_dir: str, out_dir: str | None = None, overwrite: bool = False,
          metrics_file: str | None = None) -> PlotsFolder:
    """The folder for the plots of ``run_dir``'s metrics: ``out_dir``, default
    ``run_dir/plots``, when the rules of the module docstring allow writing into it
    (``overwrite``: whatever it holds). ``metrics_file``: a JSONL named by itself (not a
    run_dir's ``metrics.jsonl``): its default folder is ``<file without .jsonl>_plots``,
    which has no "own folder" rule (new, empty, or its own earlier plots). Reads the
    folder only; writes nothing.

    Raises:
        HDETConfigError: the folder holds another run's plots, files that are not hdet
            plots, or a record that cannot be read (without ``overwrite``), or cannot be
            listed: one line naming it, what it holds and the way out.
    """
    metrics = os.path.realpath(metrics_file or os.path.join(run_dir, "metrics.jsonl"))
    own = os.path.join(run_dir, "plots") if metrics_file is None else None
    path = out_dir or own or os.path.splitext(metrics_file)[0] + "_plots"
    if not os.path.isdir(path):  # not there yet; or a file in its place, which create() names
        return PlotsFolder(path, run_dir, metrics, set(), None)
    try:
        names = [n for n in os.listdir(path) if n != RECORD and not _TEMP.fullmatch(n)]
    except OSError as e:
        raise HDETConfigError(f"{path}: cannot list the plots folder ({e.strerror or e}); choose another --out"
                              ) from None
    record = read_record(path)
    is_own = own is not None and os.path.realpath(path) == os.path.realpath(own)
    earlier = set(record["pngs"]) if record is not None else set()
    if is_own or _run_of(path) is not None:  # a run's plots folder: every PNG of hdet-plot's names is one
        earlier |= {n for n in names if _is_plot_name(n)}
    if is_own or overwrite or (record["metrics"] == metrics if record is not None else not names):
        return PlotsFolder(path, run_dir, metrics, earlier, record)
    raise HDETConfigError(_refusal(path, names, record))


def _refusal(path: str, names: list[str], record: dict | None) -> str:
    pngs = [n for n in names if _is_plot_name(n)]
    held = f"{len(names)} file(s): {_listing(names)}" if names else "no PNG left"
    replace = "choose another --out (a new or empty folder), or add --overwrite to replace them"
    if record is _UNREADABLE:
        return (f"{path}: the folder holds a {RECORD} that hdet-plot cannot read ({held}); hdet-plot never writes "
                f"over what it cannot tell is its own: {replace}")
    owner = os.path.dirname(record["metrics"]) if record is not None else _run_of(path)
    if owner is not None and (record is not None or len(pngs) == len(names)):
        how = "" if record is not None else "; plotted before hdet-plot recorded whose plots a folder holds"
        others = [n for n in names if n not in pngs]  # a user's notes.txt is not counted a plot
        held = (f"{len(pngs)} plot(s): {_listing(pngs)}" if pngs else "no PNG left") + (
            f"; and {len(others)} other file(s): {_listing(others)}" if others else "")
        return (f"{path}: the folder holds the plots of run {_shown(owner)} ({held}{how}); hdet-plot never "
                f"replaces another run's plots: {replace}")
    if len(pngs) == len(names):
        # a user's own loss.png is not called "hdet plots of a run": it may be either
        return (f"{path}: the folder holds PNG(s) with hdet plot names but no {RECORD} saying which run made them "
                f"({held}); hdet-plot never writes over files it cannot tell are its own: {replace}")
    return (f"{path}: the folder holds files that are not hdet plots ({held}); hdet-plot writes only into a new "
            "or empty folder, the run's own plots folder or one of its earlier plots: choose another --out, or "
            "add --overwrite to write among them (a file of a plot's name is replaced, nothing else touched)")
