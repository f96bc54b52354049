"""Quality benchmark: does HDET's auto-LR find the learning rate that a grid of plain runs
finds, at the cost of one run? (docs/quality.md)

    OMP_NUM_THREADS=1 python -m benchmarks.quality --jobs 2          # runs + report
    python -m benchmarks.quality --report-only                        # report from results
    OMP_NUM_THREADS=1 python -m benchmarks.quality --jobs 1 --only schedule-free/ --only prodigy/
    python -m benchmarks.quality --device cuda --model-size large --steps 1000   # a GPU

Every run is the ``Simulator`` on the default model and corpus (``quality_runs.py``):
4 replicas x 8 sequences, 200 optimizer steps, sync every 25, 3 seeds per point. Results
go to ``benchmarks/results/quality.jsonl`` (one line per run; finished runs are skipped
when the command is repeated), the table and plots to docs/quality_table.md and
docs/quality_*.png. 132 runs of 60-100 s on one core each. Another ``--device``,
``--model-size`` or ``--steps`` writes to ``benchmarks/results/quality-<device>-<size>-<steps>steps``
(``.jsonl``, ``_table.md``, ``_*.png``) instead, so its runs never mix with these.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict

from benchmarks.pool import load, run_all
from benchmarks.quality_runs import DEFAULT_LR, MICRO, MODEL_SIZES, REPLICAS, merge, run

SEEDS = (0, 1, 2)
GRID = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
BEST = 3e-3  # the grid's best mean (checked by the report, which flags a different best)
RESULTS = "benchmarks/results/quality.jsonl"

# Variants of HDET (overrides of quality_runs.BASE_HDET). "full": the paper's full method
# with hdet_scale's controller (log controller, probe fitness, tied groups, warm init
# nu = 0.01) at step_size 0.5; the ablations change one thing of it. "defaults": the
# settings this benchmark selected as the library's defaults (step_size 0.25, no warm init).
FULL: dict = {"auto": {"step_size": 0.5}}
NO_AUTO = {"auto": {"enabled": False}}
NO_WARM = {"auto": {"step_size": 0.5}, "warm_init": {"enabled": False}}
TRAIN_LOSS = {"auto": {"fitness": "train_loss", "step_size": 0.5}}
PAPER = {"auto": {"controller": "paper", "fitness": "train_loss", "groups": "independent"}}
REPLICA = {"auto": {"step_size": 0.5}, "gradient_sharing": "replica"}
SLOW = {"auto": {"step_size": 0.25}, "warm_init": {"enabled": False}}
DROPOUT_GRID = (0.0, 0.1, 0.2)
DROPOUT_START = 0.1
DROPOUT_AXIS = {"auto": {"step_size": 0.5},
                "axes": {"lr": {"spread_ratio": 0.111},
                         "dropout": {"spread_ratio": 0.05, "kind": "additive", "value": DROPOUT_START, "auto": True}}}
# The optimizers users pick instead of tuning AdamW's LR, at their libraries' defaults
# (schedule-free also 3x below and 10x above), and HDET's defaults on schedule-free.
SF_LR = DEFAULT_LR["schedulefree"]
SF_STARTS = {"default": SF_LR, "3x low": SF_LR / 3, "10x high": SF_LR * 10}
SF_SLOW = merge(SLOW, {"schedule": {"name": "constant"}})  # schedule-free warms up itself
PEERS = ("schedule-free AdamW", "Prodigy")


def specs(steps: int = 200, device: str = "cpu", model_size: str = "default") -> list[dict]:
    """Every run; ``steps``, ``device`` and ``model_size`` go into each spec."""
    out = []
    for lr in GRID:
        for s in SEEDS:
            out.append({"name": f"plain/lr{lr:g}/s{s}", "group": "plain", "kind": "plain", "lr": lr, "seed": s})
    starts = {"best": BEST, "3x low": BEST / 3, "10x high": BEST * 10}
    for where, lr in starts.items():
        for s in SEEDS:
            out.append({"name": f"hdet full/{where}/s{s}", "group": f"HDET full, start {where}", "kind": "hdet",
                        "lr": lr, "seed": s, "hdet": FULL})
    ablations = {"without auto-LR": NO_AUTO, "without warm init": NO_WARM,
                 "train-loss fitness": TRAIN_LOSS, "paper controller": PAPER, "replica mode": REPLICA}
    for label, over in ablations.items():
        for where in ("3x low", "10x high"):
            for s in SEEDS:
                out.append({"name": f"hdet {label}/{where}/s{s}", "group": f"HDET {label}, start {where}",
                            "kind": "hdet", "lr": starts[where], "seed": s, "hdet": over})
    # The controller's step: half the default, without warm init, from every start.
    for where, lr in starts.items():
        for s in SEEDS:
            out.append({"name": f"hdet step 0.25 no warm/{where}/s{s}", "group": f"HDET defaults, start {where}",
                        "kind": "hdet", "lr": lr, "seed": s, "hdet": SLOW})
    # Parameter groups: decay / no-decay groups explored tied (default) or independently.
    for label, mode in (("tied", "tied"), ("independent", "independent")):
        for s in SEEDS:
            out.append({"name": f"hdet 2 groups {label}/3x low/s{s}", "group": f"HDET 2 groups {label}, start 3x low",
                        "kind": "hdet", "lr": starts["3x low"], "seed": s, "two_groups": True,
                        "hdet": {"auto": {"groups": mode, "step_size": 0.5}}})
    # Why a start 10x too high is not recovered: plain runs whose LR is cut by hand once
    # (what a perfect controller could do at its first syncs).
    for at, f in ((10, 0.1), (25, 0.3), (50, 0.15)):
        for s in SEEDS:
            out.append({"name": f"drop/at{at}x{f:g}/s{s}", "group": f"plain 10x high, LR x{f:g} from step {at}",
                        "kind": "plain", "lr": starts["10x high"], "seed": s, "drop": {"at": at, "factor": f}})
    # A regularisation axis with the LR (issue 12): plain runs over a small dropout grid at
    # the best LR (dropout 0 too: the LR grid's runs predate the current weight init), and
    # HDET exploring dropout (additive spread 0.05 around 0.1, auto on) beside the LR.
    for p in DROPOUT_GRID:
        for s in SEEDS:
            out.append({"name": f"plain dropout/p{p:g}/s{s}", "group": f"plain, dropout {p:g}", "kind": "plain",
                        "lr": BEST, "seed": s, "dropout": p})
    for s in SEEDS:
        out.append({"name": f"hdet lr+dropout/best/s{s}", "group": "HDET full + dropout axis, start best",
                    "kind": "hdet", "lr": BEST, "seed": s, "dropout": DROPOUT_START, "hdet": DROPOUT_AXIS})
    # Where plain training is fragile: no gradient clipping, high LR.
    for lr in (1e-1,):
        for s in SEEDS:
            out.append({"name": f"noclip plain/lr{lr:g}/s{s}", "group": "no clipping: plain",
                        "kind": "plain", "lr": lr, "seed": s, "clip": 0.0})
            out.append({"name": f"noclip hdet/lr{lr:g}/s{s}", "group": "no clipping: HDET full",
                        "kind": "hdet", "lr": lr, "seed": s, "hdet": FULL, "clip": 0.0})
    # Names chosen so that "--only schedule-free/ --only prodigy/" selects the plain peers.
    for where, lr in SF_STARTS.items():
        for s in SEEDS:
            out.append({"name": f"schedule-free/lr{lr:.3g}/s{s}", "group": "schedule-free AdamW", "kind": "plain",
                        "optimizer": "schedulefree", "lr": lr, "seed": s})
    if model_size == "small":  # its schedule-free optimum is wider: 20x its default too
        for s in SEEDS:
            out.append({"name": f"schedule-free/lr{SF_LR * 20:.3g}/s{s}", "group": "schedule-free AdamW",
                        "kind": "plain", "optimizer": "schedulefree", "lr": SF_LR * 20, "seed": s})
            # HDET's spread without auto-LR at that optimum: what the spread alone costs
            out.append({"name": f"hdet no auto + schedule-free AdamW/10x high/s{s}",
                        "group": "HDET without auto-LR + schedule-free, start 10x high", "kind": "hdet",
                        "optimizer": "schedulefree", "lr": SF_STARTS["10x high"], "seed": s,
                        "hdet": merge(SF_SLOW, NO_AUTO)})
    for s in SEEDS:
        out.append({"name": f"prodigy/lr1/s{s}", "group": "Prodigy", "kind": "plain", "optimizer": "prodigy",
                    "lr": DEFAULT_LR["prodigy"], "seed": s})
    for where, lr in SF_STARTS.items():
        for s in SEEDS:
            out.append({"name": f"hdet defaults + schedule-free AdamW/{where}/s{s}",
                        "group": f"HDET defaults + schedule-free, start {where}", "kind": "hdet",
                        "optimizer": "schedulefree", "lr": lr, "seed": s, "hdet": SF_SLOW})
    # HDET's defaults on AdamW again with the current weight init (the rows above predate
    # it), and the controller before auto.noise_scale (the probe's mean alone: z-scores)
    for where, lr in (("best", BEST), ("3x low", BEST / 3)):
        for s in SEEDS:
            out.append({"name": f"hdet defaults ci/{where}/s{s}", "group": f"HDET defaults, decay_moves both, current init, start {where}",
                        "kind": "hdet", "lr": lr, "seed": s, "hdet": SLOW})
            out.append({"name": f"hdet z-scores ci/{where}/s{s}",
                        "group": f"HDET defaults without the noise term, current init, start {where}",
                        "kind": "hdet", "lr": lr, "seed": s, "hdet": SLOW, "probe_examples": False})
    # From 1e-2: the small model's best AdamW LR at 1000 steps (docs/quality.md, longer runs)
    for s in SEEDS:
        out.append({"name": f"hdet defaults ci/lr0.01/s{s}", "group": "HDET defaults, decay_moves both, current init, start 1e-2",
                    "kind": "hdet", "lr": 1e-2, "seed": s, "hdet": SLOW})
    # Every row above was measured before auto.decay_moves, with the multiplier free to
    # move either way during the schedule's decay ("both"); the rows below use its default
    # ("up": during the decay the multiplier may only rise).
    for o in out:
        if o["kind"] == "hdet":
            o["hdet"] = merge(o.get("hdet", {}), {"auto": {"decay_moves": "both"}})
    # Scoring each replica between it and the replicas' mean (quality_runs "toward_mean"):
    # a prototype against the short-horizon bias, measured at 1000 steps on the small model
    if model_size == "small":
        for beta in (0.5, 0.25):
            for lr in (1e-2, BEST):
                out.append({"name": f"hdet toward mean b{beta:g}/lr{lr:g}/s0",
                            "group": f"HDET, probe toward the mean (beta {beta:g}), decay_moves both, start {lr:g}",
                            "kind": "hdet", "lr": lr, "seed": 0, "hdet": merge(SLOW, {"auto": {"decay_moves": "both"}}),
                            "probe_point": "toward_mean", "probe_beta": beta})
    for where, label, lr in (("best", "best", BEST), ("3x low", "3x low", BEST / 3),
                             ("10x high", "10x high", BEST * 10), ("lr0.01", "1e-2", 1e-2)):
        for s in SEEDS:
            out.append({"name": f"hdet defaults up/{where}/s{s}", "group": f"HDET defaults (decay_moves up), start {label}",
                        "kind": "hdet", "lr": lr, "seed": s, "hdet": SLOW})
    # a prototype against the creep under schedule-free's constant schedule: score between x
    # (whose comparison favours larger steps) and y (whose comparison favours smaller ones)
    for where in ("default", "10x high"):
        for s in SEEDS:
            out.append({"name": f"hdet between xy + schedule-free AdamW/{where}/s{s}",
                        "group": f"HDET defaults + schedule-free, probe between x and y, start {where}",
                        "kind": "hdet", "optimizer": "schedulefree", "lr": SF_STARTS[where], "seed": s,
                        "hdet": SF_SLOW, "probe_point": "between_xy", "probe_alpha": 0.5})
            for alpha in (0.25, 0.1):
                out.append({"name": f"hdet between xy a{alpha:g} + schedule-free AdamW/{where}/s{s}",
                            "group": f"HDET defaults + schedule-free, probe x + {alpha:g} (y - x), start {where}",
                            "kind": "hdet", "optimizer": "schedulefree", "lr": SF_STARTS[where], "seed": s,
                            "hdet": SF_SLOW, "probe_point": "between_xy", "probe_alpha": alpha})
    # a prototype: every replica weights its z's into x as the spread's top LR would
    for where in ("default", "10x high"):
        for s in SEEDS:
            out.append({"name": f"hdet hold lr_max + schedule-free AdamW/{where}/s{s}",
                        "group": f"HDET defaults + schedule-free, lr_max held at the spread's top, start {where}",
                        "kind": "hdet", "optimizer": "schedulefree", "lr": SF_STARTS[where], "seed": s,
                        "hdet": SF_SLOW, "hold_lr_max": True})
    return [{**o, "steps": steps, "device": device, "model_size": model_size} for o in out]


def _stats(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _final_lr(r: dict) -> float | None:
    """The effective peak LR the run ended with: start peak x the last multiplier."""
    mult = [t["multiplier"] for t in r.get("trace", []) if t.get("multiplier") is not None]
    return r["lr"] * mult[-1] if mult else None


def _settings(r: dict) -> tuple:
    return r.get("device", "cpu"), r.get("model_size", "default"), r.get("steps", 200)


def _cost(r: dict) -> float:
    """Sequence passes relative to one plain run of the same length."""
    return r["passes"] / (3 * r.get("steps", 200) * REPLICAS * MICRO)


def report(results: list[dict], plot_prefix: str) -> str:
    """The table (returned) and the plots ``<plot_prefix>_grid.png`` / ``_multiplier.png``."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[r["group"]].append(r)
    grid = {lr: _stats([r["val_loss"] for r in groups.get("plain", []) if r["lr"] == lr and r["val_loss"]])
            for lr in GRID if any(r["lr"] == lr for r in groups.get("plain", []))}
    best_lr = min(grid, key=lambda k: grid[k][0]) if grid else None
    lines = ["| run | start LR | val loss (mean +- std, nats/byte) | seeds | diverged | final peak LR (mean) | "
             "compute vs one plain run |", "|---|---|---|---|---|---|---|"]
    order = ("plain",) + PEERS  # the peers beside the AdamW grid
    for name in sorted(groups, key=lambda g: (order.index(g) if g in order else len(order), g)):
        rs = groups[name]
        by_lr = defaultdict(list)
        for r in rs:
            by_lr[r["lr"]].append(r)
        for lr, rr in sorted(by_lr.items()):
            ok = [r["val_loss"] for r in rr if r["val_loss"] is not None]
            m, s = _stats(ok) if ok else (math.nan, math.nan)
            finals = [f for f in (_final_lr(r) for r in rr) if f]
            fin = f"{statistics.fmean(finals):.2e}" if finals else "-"
            cost = statistics.fmean(_cost(r) for r in rr)
            lines.append(f"| {name} | {lr:g} | {m:.3f} +- {s:.3f} | {len(rr)} | {sum(r['diverged'] for r in rr)} | "
                         f"{fin} | {cost:.3f} |")
    table = "\n".join(lines)
    if best_lr is not None:
        table += (f"\n\nBest grid point: lr {best_lr:g}, {grid[best_lr][0]:.3f} +- {grid[best_lr][1]:.3f}. "
                  f"The plain grid ({len(grid)} points x {len(SEEDS)} seeds) costs {len(grid)}x one run per seed.")
    _plots(groups, grid, plot_prefix, results[0].get("steps", 200) if results else 200)
    return table


def _plots(groups: dict, grid: dict, plot_prefix: str, steps: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    os.makedirs(os.path.dirname(plot_prefix) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    lrs = sorted(grid)
    ax.errorbar(lrs, [grid[k][0] for k in lrs], yerr=[grid[k][1] for k in lrs], marker="o", color="k",
                label="plain data parallelism (grid)")
    colors = {"3x low": "tab:blue", "best": "tab:green", "10x high": "tab:red"}
    for variant, marker in (("defaults", "*"), ("full", "^")):
        for where, c in colors.items():
            rs = groups.get(f"HDET {variant}, start {where}", [])
            vals = [r["val_loss"] for r in rs if r["val_loss"] is not None]
            finals = [f for f in (_final_lr(r) for r in rs) if f]
            if vals and finals:
                m, s = _stats(vals)
                ax.errorbar([statistics.fmean(finals)], [m], yerr=[s], marker=marker, markersize=12, color=c,
                            ls="none", label=f"HDET {variant} from {where} (x: final peak LR)")
                ax.axvline(rs[0]["lr"], color=c, ls=":", lw=1)
    sf = defaultdict(list)
    for r in groups.get("schedule-free AdamW", []):
        if r["val_loss"] is not None:
            sf[r["lr"]].append(r["val_loss"])
    if sf:
        lrs_sf = sorted(sf)
        ax.errorbar(lrs_sf, [_stats(sf[k])[0] for k in lrs_sf], yerr=[_stats(sf[k])[1] for k in lrs_sf],
                    marker="s", color="tab:purple", label="schedule-free AdamW (x: its LR, no schedule)")
    now = [r["val_loss"] for r in groups.get("plain, dropout 0", []) if r["val_loss"] is not None]
    if now:  # the grid predates the current weight init; the peers were measured with it
        ax.errorbar([BEST], [_stats(now)[0]], yerr=[_stats(now)[1]], marker="o", mfc="none", color="k", ls="none",
                    label=f"plain at {BEST:g}, current weight init")
    prodigy = [r["val_loss"] for r in groups.get("Prodigy", []) if r["val_loss"] is not None]
    if prodigy:  # no LR to place it at: a band
        m, s = _stats(prodigy)
        ax.axhspan(m - s, m + s, color="tab:orange", alpha=0.2)
        ax.axhline(m, color="tab:orange", lw=1.5, label="Prodigy, lr 1 x OneCycle (band: +- std)")
    ax.set_xscale("log")
    ax.set_xlabel("peak LR")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"{steps} steps, 4 x 8 sequences, 3 seeds (dotted: HDET start LR)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: the points fill the axes
    fig.tight_layout()
    fig.savefig(plot_prefix + "_grid.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for where, c in colors.items():
        for r in groups.get(f"HDET defaults, start {where}", []):
            tr = [t for t in r.get("trace", []) if t.get("multiplier") is not None]
            if tr:
                ax.plot([0] + [t["step"] for t in tr], [r["lr"]] + [r["lr"] * t["multiplier"] for t in tr],
                        color=c, marker=".", alpha=0.7, label=f"start {where}" if r["seed"] == 0 else None)
    best = min(grid, key=lambda k: grid[k][0]) if grid else None
    if best:
        ax.axhline(best, color="k", ls="--", lw=1, label="best grid LR")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step (sync)")
    ax.set_ylabel("peak LR x auto-LR multiplier")
    ax.set_title("Auto-LR multiplier per sync, HDET defaults (one line per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_prefix + "_multiplier.png", dpi=110)
    plt.close(fig)


def dropout_report(results: list[dict]) -> str:
    """The dropout axis (issue 12): the plain dropout grid at the best LR, and where HDET's
    dropout base ended (mean +- std over seeds) against the grid's best point."""
    grid = {}
    for p in DROPOUT_GRID:
        rs = [r for r in results if r["name"].startswith("plain dropout/") and r.get("dropout") == p
              and r["val_loss"] is not None]
        if rs:
            grid[p] = _stats([r["val_loss"] for r in rs]) + (len(rs),)
    hd = [r for r in results if r["group"] == "HDET full + dropout axis, start best"]
    lines = ["| run | dropout | val loss (mean +- std) | seeds |", "|---|---|---|---|"]
    lines += [f"| plain, lr {BEST:g} | {p:g} | {m:.3f} +- {sd:.3f} | {n} |" for p, (m, sd, n) in sorted(grid.items())]
    if hd:
        finals = [[t["dropout"] for t in r["trace"] if t.get("dropout") is not None][-1] for r in hd if r["trace"]]
        m, sd = _stats([r["val_loss"] for r in hd if r["val_loss"] is not None])
        fm, fsd = _stats(finals)
        lines.append(f"| HDET lr + dropout, start lr {BEST:g} | {DROPOUT_START:g} -> {fm:.3f} +- {fsd:.3f} | "
                     f"{m:.3f} +- {sd:.3f} | {len(hd)} |")
    best = min(grid, key=lambda k: grid[k][0]) if grid else None
    tail = f"\n\nBest dropout of the grid: {best:g}." if best is not None else ""
    return "\n".join(lines) + tail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    p.add_argument("--results", help=f"JSONL of the runs (default {RESULTS} for the default settings)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", help="where the table is written, the plots beside it "
                                 "(default docs/quality_table.md for the default settings)")
    p.add_argument("--only", action="append", metavar="SUBSTRING",
                   help="run only the specs whose name contains it (repeatable; the report covers every result)")
    p.add_argument("--device", default="cpu", help="torch device of the runs, e.g. cuda")
    p.add_argument("--model-size", default="default", choices=list(MODEL_SIZES))
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    mine = (a.device, a.model_size, a.steps)
    tag = "" if mine == ("cpu", "default", 200) else f"-{a.device}-{a.model_size}-{a.steps}steps"
    results_path = a.results or (RESULTS if not tag else f"benchmarks/results/quality{tag}.jsonl")
    out = a.out or ("docs/quality_table.md" if not tag else f"benchmarks/results/quality{tag}_table.md")
    if os.path.exists(results_path):
        other = {_settings(r) for r in load(results_path)} - {mine}
        if other:  # run names do not say the settings: skipping by name would mix them
            sys.exit(f"{results_path} holds runs of other (device, model size, steps): {sorted(other)}; "
                     "pass --results of their own")
    if not a.report_only:
        todo = [s for s in specs(a.steps, a.device, a.model_size) if not a.only or any(o in s["name"] for o in a.only)]
        run_all(todo, run, results_path, a.jobs)
    if not os.path.exists(results_path):
        sys.exit(f"no results in {results_path}: run without --report-only first")
    results = load(results_path)
    prefix = os.path.join(os.path.dirname(out), "quality" + tag)
    table = report(results, prefix) + "\n\n" + dropout_report(results)
    with open(out, "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
