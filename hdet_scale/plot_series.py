"""The numbers ``hdet-plot`` draws, read from a run's ``metrics.jsonl``.

:func:`read_records` reads the records (a cut-off last line skipped; a plotted value that
is not a number skipped with one note per key), :func:`series` turns them into the
per-axis fan-out, the base value against the plain schedule, the syncs and the losses,
indexed by optimizer step. Split from ``hdet_scale/plot.py``, which draws them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from hdet_scale.safe_parse import json_loads  # deep nesting is a ValueError
from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import require_regular

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
    integer is left out whole; a plotted value at a step before the one it was last
    logged at (at that step again, but for a replica's axis value, logged twice at a
    sync) is left out too: ``log`` gets one line per key, naming the first line and how
    many more there are.

    Raises:
        HDETConfigError: the file is missing, unreadable, has no record, or a line is not
            a JSON object (the message names the file and line).
    """
    require_regular(path, "metrics file")  # a FIFO would block open() forever
    try:
        # Bytes that are not UTF-8 become U+FFFD, so such a line is named as no JSON
        # record below, not a UnicodeDecodeError traceback.
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise HDETConfigError(f"{path}: cannot read the metrics file ({e.strerror or e}); "
                              "pass the run_dir of an hdet-train run") from None
    records, cut = [], None
    bad: dict[str, list] = {}  # key -> [first line, its value, how many]
    last: dict[str, int] = {}  # key -> the step it was last drawn at
    order: dict[str, list] = {}  # key -> [first line, its step, the step before, how many]
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json_loads(line, parse_float=_parse_float)
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
        if isinstance(step := rec.get("step"), int):
            # a record appended at an earlier step would draw the curve back to it without
            # a word. A replica's axis value is logged twice at a sync (before and
            # after it): only a step before the last is out of order for those.
            for key in [k for k in rec if _PLOTTED.match(k)]:
                prev = last.get(key)
                if prev is not None and (step < prev or step == prev and not _VALUE.match(key)):
                    order.setdefault(key, [i, step, prev, 0])[3] += 1
                    rec.pop(key)
                else:
                    last[key] = step
        records.append(rec)
    for key, (i, step, prev, count) in order.items():
        if log is not None:
            more = f" (and {count - 1} more such value(s) of {key})" if count > 1 else ""
            log(f"{path}:{i}: {key} at step {step}, not after step {prev} where it was logged before: skipped, the "
                f"records are out of step order (lines appended from another run?){more}")
    for key, (i, value, count) in bad.items():
        if log is not None:
            more = f" (and {count - 1} more such value(s) of {key})" if count > 1 else ""
            what = "is not an integer step: record skipped" if key == "step" else "is not a number: skipped"
            log(f"{path}:{i}: {key} = {repr(value)[:40]} {what}{more}")
    if records and cut is not None and log is not None:  # not left out without a word
        log(f"{path}:{len(lines)}: the last line is cut short (the record a stopped or running job was writing): "
            "left out")
    if not records and cut is not None and not lines[-1].lstrip().startswith("{"):
        # a binary file (no newline) is not "no record (did the run log a step?)"
        raise HDETConfigError(f"{cut}; an hdet-train metrics file holds one JSON object per line")
    if not records:
        raise HDETConfigError(f"{path}: the metrics file holds no record (did the run log a step?)")
    if "step" in bad and not any(isinstance(r.get("step"), int) for r in records):
        # its records were all left out for their steps: "no record of an hdet-train run"
        # after the step lines would mislead
        raise HDETConfigError(f"{path}: no record has an integer step (the values of step above were skipped): "
                              "hdet-train logs the optimizer step, an integer, with every record")
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
        (per-step records, and sync records at steps without one: a sync record
        repeats its step's values);
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
    # a sync record holds the values its step ran with: the fan-out at the steps that
    # logging.every leaves without a per-step record (else every = 50 at T = 10 draws
    # the fan-out at every 50th step, none of the syncs between)
    stepped = {r["step"] for r in steps}
    for rec in syncs:
        if rec["step"] in stepped:
            continue
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
    updated = any(any(k.startswith("hdet/weight/") for k in r) for r in syncs)  # auto-LR ran
    # another axis's multiplier logged: this one is not under auto-LR (not the "paper"
    # controller's, which logs no multiplier for any axis)
    others = any(k.startswith("hdet/") and k.endswith("/multiplier") for r in syncs for k in r)
    if updated and not others:  # controller "paper"
        return {**res, "plain": None, "shown": "base (mean of replicas); auto.controller paper logs no multiplier"}
    why = "not under auto-LR" if updated else "no auto-LR update ran"
    return {**res, "plain": None, "shown": f"base (mean of replicas) = plain schedule ({why})"}
