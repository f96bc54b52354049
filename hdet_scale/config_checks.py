"""The range and cross-key checks of a parsed ``"hdet"`` block (docs/config.md).

Pure: no ``torch.distributed``, so every rank reaches the same verdict. Each problem is
one ``"<dotted key>: <what is wrong>"`` line; :meth:`hdet_scale.config.HDETConfig.from_dict`
raises them together in one :class:`~hdet_scale.errors.HDETConfigError`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hdet_scale import axis_specs

if TYPE_CHECKING:
    from hdet_scale.config import HDETConfig

GRADIENT_SHARING = ("global", "replica")
SCHEDULES = ("onecycle", "cosine", "constant")
CONTROLLERS = ("log", "paper")
FITNESS = ("probe", "train_loss")
GROUP_MODES = ("tied", "independent")
DECAY_MOVES = ("up", "hold", "both")


#: The most optimizer steps a run may have: float64 holds every step count up to it exactly.
MAX_STEPS = 2 ** 53


def _phase_message(n: int, pc: float, three_phase: bool) -> str:
    """Why ``pct_start`` gives OneCycle a phase without steps, and the values that work
    for this run length (not "phase ends [-0.6, 1]" for train.steps=2)."""
    high = (n + 1) / (2 * n) if three_phase else 1.0  # from the phase ends' order
    head = (f"{pc:g} x total_steps={n} gives OneCycle {pc * n:g} warm-up steps, a phase of zero or negative length "
            f"(it needs 1 < pct_start * total_steps"
            + (" and 2 * pct_start * total_steps - 1 < total_steps)" if three_phase else " < total_steps)"))
    if 1 / n < high:
        return f"{head}; with total_steps={n} pct_start must be in ({1 / n:.4g}, {high:.4g})"
    return f"{head}; no pct_start works with total_steps={n}: run longer, or use schedule.name constant or cosine"


def seed_ok(seed: object) -> bool:
    """A seed ``torch.manual_seed`` accepts (an integer in [-2**63, 2**64)); beyond, it
    raises on every rank after start-up."""
    return isinstance(seed, int) and not isinstance(seed, bool) and -2 ** 63 <= seed < 2 ** 64


def _reported(errors: list[str], key: str) -> bool:
    """Whether ``key`` or a block above it already has an error in ``errors``."""
    parts = key.split(".")
    return any(e.startswith(tuple(".".join(parts[:i]) + ": " for i in range(1, len(parts) + 1))) for e in errors)


def _check(errors: list[str], ok: bool, key: str, message: str, reads: tuple[str, ...] = ()) -> None:
    # A key already reported, or its block (a wrong type: the default stands in), is not
    # judged again on the stand-in: "expected int, got 10.5" then "must be >= 1, got None"
    # would contradict itself. Nor is a check across keys when a key it also reads
    # (``reads``) was refused: sync_interval=5.0 would draw a warmup_steps verdict computed
    # with the default sync_interval 1000, which the user never set.
    if not ok and not any(_reported(errors, k) for k in (key, *reads)):
        errors.append(f"{key}: {message}")


def validate(cfg: "HDETConfig", p: str, errors: list[str]) -> None:
    """Appends to ``errors`` one ``"<dotted key>: <what is wrong>"`` line per problem of a
    parsed, enabled block ``cfg`` (``p``: the block's own dotted key, e.g. ``"hdet"``)."""
    _check(errors, cfg.replicas >= 1, f"{p}.replicas", f"must be an integer >= 1, got {cfg.replicas}")
    _check(errors, cfg.sync_interval >= 1, f"{p}.sync_interval",
           f"must be an integer >= 1 (optimizer steps), got {cfg.sync_interval}")
    _check(errors, cfg.gradient_sharing in GRADIENT_SHARING, f"{p}.gradient_sharing",
           f"must be one of {', '.join(GRADIENT_SHARING)}, got {cfg.gradient_sharing!r}")
    _check(errors, cfg.bucket_mb > 0, f"{p}.bucket_mb", f"must be > 0 (MiB), got {cfg.bucket_mb}")
    for key, seed in ((f"{p}.seed", cfg.seed), (f"{p}.warm_init.seed", cfg.warm_init.seed)):
        _check(errors, seed_ok(seed), key, f"must be an integer in [-2**63, 2**64) (torch.manual_seed's range), "
               f"got {seed}")
    for name, axis in cfg.axes.items():
        k = f"{p}.axes.{name}"
        _check(errors, axis.kind in ("multiplicative", "additive"), f"{k}.kind",
               f"must be 'multiplicative' or 'additive', got {axis.kind!r}")
        _check(errors, math.isfinite(axis.spread_ratio) and axis.spread_ratio >= 0, f"{k}.spread_ratio",
               f"must be finite and >= 0, got {axis.spread_ratio}")
        if axis.kind == "multiplicative":
            _check(errors, axis.spread_ratio < 1, f"{k}.spread_ratio",
                   f"must be in [0, 1) for a multiplicative axis (a multiplier 1 - spread_ratio "
                   f"must stay > 0), got {axis.spread_ratio}", reads=(f"{k}.kind",))
        if name == "lr":
            _check(errors, axis.kind == "multiplicative", f"{k}.kind", "the lr axis must be multiplicative")
        axis_specs.validate(name, axis, k, errors, _check)
        if axis.groups is not None:
            _check(errors, len(axis.groups) > 0 and all(g >= 0 for g in axis.groups), f"{k}.groups",
                   f"must be a non-empty list of parameter-group indices >= 0 or null, got {axis.groups}")
            # A repeated index would run that group's meta-update twice per sync.
            twice = sorted({g for g in axis.groups if axis.groups.count(g) > 1})
            _check(errors, not twice, f"{k}.groups", f"lists parameter group(s) {twice} more than once: "
                   f"each index once, got {axis.groups}")
    s, k = cfg.schedule, f"{p}.schedule"
    _check(errors, s.name in SCHEDULES, f"{k}.name", f"must be one of {', '.join(SCHEDULES)}, got {s.name!r}")
    _check(errors, s.total_steps is not None and s.total_steps >= 1, f"{k}.total_steps",
           f"must be an integer >= 1 (optimizer steps in the run), got {s.total_steps}")
    if s.max_lr is not None:
        peaks = s.max_lr if isinstance(s.max_lr, list) else [s.max_lr]
        _check(errors, all(v > 0 and math.isfinite(v) for v in peaks), f"{k}.max_lr",
               f"must be > 0 (a float, a list per parameter group, or null), got {s.max_lr}")
    _check(errors, 0 <= s.pct_start <= 1, f"{k}.pct_start", f"must be in [0, 1], got {s.pct_start}")
    if s.name == "onecycle" and s.total_steps is not None and s.total_steps >= 1:
        # Same phase ends as OneCycleLR; a zero-length phase divides by zero there too.
        n, pc = s.total_steps, s.pct_start
        ends = [0.0, float(pc * n) - 1] + ([float(2 * pc * n) - 2] if s.three_phase else []) + [n - 1]
        _check(errors, all(b > a for a, b in zip(ends, ends[1:])), f"{k}.pct_start",
               _phase_message(n, pc, s.three_phase),
               reads=(f"{k}.name", f"{k}.total_steps", f"{k}.three_phase"))
    _check(errors, s.anneal_strategy in ("cos", "linear"), f"{k}.anneal_strategy",
           f"must be 'cos' or 'linear', got {s.anneal_strategy!r}")
    _check(errors, s.div_factor > 0, f"{k}.div_factor", f"must be > 0, got {s.div_factor}")
    _check(errors, s.final_div_factor > 0, f"{k}.final_div_factor", f"must be > 0, got {s.final_div_factor}")
    _check(errors, 0 <= s.min_ratio <= 1, f"{k}.min_ratio", f"must be in [0, 1], got {s.min_ratio}")
    _check(errors, s.warmup_steps >= 0, f"{k}.warmup_steps", f"must be >= 0, got {s.warmup_steps}")
    if s.name != "onecycle" and s.total_steps is not None and s.total_steps >= 1:
        # a warm-up past the run's end never reaches the peak (2e-5 of 3e-3)
        _check(errors, s.warmup_steps < s.total_steps, f"{k}.warmup_steps",
               f"must be shorter than the run (total_steps={s.total_steps}), got {s.warmup_steps}: the LR would "
               "never reach its peak", reads=(f"{k}.name", f"{k}.total_steps"))
    _check(errors, s.total_steps is None or s.total_steps <= MAX_STEPS, f"{k}.total_steps",
           f"must be at most 2**53 (optimizer steps; the schedules compute in float64), got {s.total_steps}")
    _check(errors, not (s.cycle_momentum and s.name != "onecycle"), f"{k}.cycle_momentum",
           "needs schedule.name = 'onecycle'", reads=(f"{k}.name",))
    a, k = cfg.auto, f"{p}.auto"
    _check(errors, a.controller in CONTROLLERS, f"{k}.controller",
           f"must be one of {', '.join(CONTROLLERS)}, got {a.controller!r}")
    _check(errors, a.fitness in FITNESS, f"{k}.fitness", f"must be one of {', '.join(FITNESS)}, got {a.fitness!r}")
    _check(errors, a.groups in GROUP_MODES, f"{k}.groups", f"must be one of {', '.join(GROUP_MODES)}, got {a.groups!r}")
    if isinstance(a.temperature, str):
        _check(errors, a.temperature == "auto", f"{k}.temperature",
               f"must be a float > 0 (nats), 'auto' or null, got {a.temperature!r}")
    elif a.temperature is not None:
        _check(errors, 0 < a.temperature < math.inf, f"{k}.temperature",
               f"must be finite and > 0, got {a.temperature}")
    _check(errors, a.momentum is None or 0 <= a.momentum < 1, f"{k}.momentum", f"must be in [0, 1), got {a.momentum}")
    _check(errors, a.step_size is None or 0 <= a.step_size < math.inf, f"{k}.step_size",
           f"must be finite and >= 0, got {a.step_size}")
    _check(errors, a.warmup_steps >= 0, f"{k}.warmup_steps", f"must be >= 0 (optimizer steps), got {a.warmup_steps}")
    _check(errors, 1 <= a.max_factor < math.inf, f"{k}.max_factor", f"must be finite and >= 1, got {a.max_factor}")
    _check(errors, 0 <= a.noise_scale < math.inf, f"{k}.noise_scale",
           f"must be finite and >= 0, got {a.noise_scale}")
    _check(errors, a.decay_moves in DECAY_MOVES, f"{k}.decay_moves",
           f"must be one of {', '.join(DECAY_MOVES)}, got {a.decay_moves!r}")
    pinned = [n for n, ax in cfg.axes.items()
              if ax.kind == "multiplicative" and cfg.axis_auto(n)]
    if a.enabled and a.controller == "log" and a.max_factor == 1 and pinned:  # otherwise silent
        _check(errors, False, f"{k}.max_factor",
               f"must be > 1 with auto.controller 'log': 1 bounds the multiplier of {', '.join(pinned)} to "
               f"[1, 1], so auto-LR would move nothing; raise it (default 100) or set {k}.enabled=false",
               reads=(f"{k}.enabled", f"{k}.controller"))
    for name in ("dropout", "label_smoothing"):  # a bias, not a measure
        if a.enabled and a.fitness == "train_loss" and name in cfg.axes and cfg.axes[name].auto is True:
            _check(errors, False, f"{p}.axes.{name}.auto",
                   f"auto-LR cannot move {name} on fitness 'train_loss': each replica's training loss is measured "
                   f"with its own {name}, so the replica with less always scores better and the base would only "
                   f"fall; use auto.fitness 'probe' (measured with dropout off and no smoothing) or auto false",
                   reads=(f"{k}.fitness",))
    if isinstance(a.decay, str):
        _check(errors, a.decay == "auto", f"{k}.decay", f"must be a float in [0, 1) or 'auto', got {a.decay!r}")
    else:
        _check(errors, 0 <= a.decay < 1, f"{k}.decay", f"must be in [0, 1) (gamma per sync), got {a.decay}")
        _check(errors, a.controller == "paper" or a.decay == 0, f"{k}.decay",
               "is a setting of controller 'paper' (the 'log' controller follows the schedule's own decay); "
               "remove it or set auto.controller='paper'", reads=(f"{k}.controller",))
    w = cfg.warm_init
    _check(errors, math.isfinite(w.nu) and 0 <= w.nu <= 1, f"{p}.warm_init.nu",
           f"must be in [0, 1] (noise std relative to the weights' RMS; paper 0.01), got {w.nu}")
    if a.enabled and s.total_steps is not None:
        run_keys = (f"{k}.enabled", f"{p}.schedule.total_steps")
        # "lower it" alone, when sync_interval is past the run too, would lead to the next
        # refusal (no sync after warm-up): both ways out named at once
        no_sync = cfg.sync_interval > s.total_steps
        _check(errors, a.warmup_steps < s.total_steps, f"{k}.warmup_steps",
               f"must be shorter than the run (schedule.total_steps={s.total_steps}), got {a.warmup_steps}; "
               + (f"lower it and {p}.sync_interval ({cfg.sync_interval}: no sync in the run either), "
                  if no_sync else "lower it ") + f"or set {k}.enabled=false",
               reads=(*run_keys, f"{p}.sync_interval"))
        first = cfg.first_meta_step if cfg.sync_interval >= 1 else 0
        _check(errors, first <= s.total_steps, f"{k}.warmup_steps",
               f"leaves no sync after warm-up: the first sync at or after warmup_steps ({a.warmup_steps}) is step "
               f"{first} (sync_interval {cfg.sync_interval}), past schedule.total_steps ({s.total_steps})",
               reads=(*run_keys, f"{p}.sync_interval"))
    lg = cfg.logging
    _check(errors, lg.every >= 1, f"{p}.logging.every", f"must be >= 1, got {lg.every}")
    _check(errors, lg.wandb.mode in (None, "online", "offline", "disabled"), f"{p}.logging.wandb.mode",
           f"must be null, 'online', 'offline' or 'disabled', got {lg.wandb.mode!r}")
