"""Typed configuration of the DeepSpeed ``"hdet"`` block, validated before any collective.

Every key is documented in docs/config.md. Parsing is pure (no ``torch.distributed``), so
all ranks reach the same verdict from the same JSON and a bad value fails fast on every
rank. All problems found in one block are reported together in one
:class:`~hdet_scale.errors.HDETConfigError`, each naming its dotted key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from hdet_scale import axis_specs
from hdet_scale.axis_specs import AXIS_NAMES
from hdet_scale.errors import HDETConfigError

GRADIENT_SHARING = ("global", "replica")
SCHEDULES = ("onecycle", "cosine", "constant")
CONTROLLERS = ("log", "paper")
FITNESS = ("probe", "train_loss")
GROUP_MODES = ("tied", "independent")


@dataclass
class AxisConfig:
    """One explored hyperparameter (HDET.md "Fan-out"; paper Sec. 3.1).

    ``spread_ratio`` is alpha: replica multipliers lie in ``[1 - alpha, 1 + alpha]``
    (multiplicative) or offsets in ``[-alpha, +alpha]`` (additive). ``groups`` lists the
    optimizer parameter-group indices explored (``None``: all; optimizer-side axes only).
    ``auto`` lets the auto-LR controller move this axis' base value. ``bounds``: ``[lo,
    hi]`` every replica's value stays in (default per axis:
    :data:`hdet_scale.axis_specs.DEFAULT_BOUNDS`). Model-side axes (dropout, temperature,
    label_smoothing: :mod:`hdet_scale.axis_specs`) take their base value from ``value``
    and ``modules`` (fnmatch patterns of module names; ``None``: every module the axis
    knows) selects what dropout and temperature set.
    """

    spread_ratio: float = 0.0
    kind: str = "multiplicative"
    groups: list[int] | None = None
    auto: bool | None = None  # None: True for "lr", False for other axes
    value: float | None = None
    bounds: list[float] | None = None
    modules: list[str] | None = None


@dataclass
class ScheduleConfig:
    """The base schedule ``eta(t)`` of the LR axis, in optimizer steps.

    ``max_lr`` is the peak LR, a float for all groups or a list per group; ``None``
    takes each parameter group's own ``lr`` (the DeepSpeed ``optimizer.params.lr``).
    The OneCycle keys mean what they mean for ``torch.optim.lr_scheduler.OneCycleLR``.
    """

    name: str = "onecycle"
    total_steps: int | None = None
    max_lr: float | list[float] | None = None
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False
    cycle_momentum: bool = False
    base_momentum: float = 0.85
    max_momentum: float = 0.95
    warmup_steps: int = 0
    min_ratio: float = 0.1


@dataclass
class AutoConfig:
    """The auto-LR controller (zero-order hypergradient; paper Sec. 3.3, Alg. 1).

    ``controller``: ``"log"`` (default) moves a multiplier ``m`` of the user's schedule in
    log space, ``lr_r = schedule(t) * m * rho_r``; ``"paper"`` is the paper's update of the
    base value itself, ``h <- h (1 - gamma) + lambda v``, kept for reproduction.
    ``fitness``: ``"probe"`` (default) scores each replica by its loss on the same probe
    batches, evaluated just before converge; ``"train_loss"`` by its mean training loss
    over the interval (the paper; each replica's own data). ``temperature``: sigma of the
    softmax over loss scores, in nats, or ``"auto"`` (the standard deviation of the
    replicas' fitness: z-scores). ``momentum``: beta of the velocity. ``step_size``: for
    ``"log"``, the change of ``log m`` per sync at full agreement (unit hypergradient);
    for ``"paper"``, lambda. ``decay``: ``"paper"`` only, gamma per sync or ``"auto"``.
    ``groups``: ``"tied"`` (one multiplier and one permutation per axis, so the user's
    ratios between parameter groups are kept) or ``"independent"`` (the paper: each group
    explored on its own). ``max_factor``: ``"log"``: bound of ``m`` to
    ``[1/max_factor, max_factor]``; ``"paper"``: the base LR stays at or above
    ``min(schedule floor, peak / max_factor)``. ``None`` values take the controller's default
    (:data:`CONTROLLER_DEFAULTS`).
    """

    enabled: bool = False
    warmup_steps: int = 0
    controller: str = "log"
    fitness: str = "probe"
    temperature: float | str | None = None
    momentum: float | None = None
    step_size: float | None = None
    decay: float | str = "auto"
    groups: str = "tied"
    max_factor: float = 100.0

    def resolved(self, name: str) -> Any:
        """``temperature`` / ``momentum`` / ``step_size`` with ``None`` replaced by the
        controller's default."""
        value = getattr(self, name)
        return CONTROLLER_DEFAULTS[self.controller][name] if value is None else value


# Defaults per controller: the paper's text for "paper"; for "log", the values the
# quality benchmark (docs/quality.md) selected.
CONTROLLER_DEFAULTS = {
    "paper": {"temperature": 0.1, "momentum": 0.9, "step_size": 0.5},
    "log": {"temperature": "auto", "momentum": 0.5, "step_size": 0.25},
}


@dataclass
class WarmInitConfig:
    """Warm noisy initialisation (paper Sec. "Warm Noisy Initialization"): before the
    first fan-out each replica adds independent Gaussian noise ``N(0, nu^2 * ||theta||^2 / d)``
    to every floating parameter, with ``||theta||`` and ``d`` the norm and parameter count
    of the whole model (the paper's text; std = ``nu * RMS(theta)``, see
    :mod:`hdet_scale.warm_init`). ``seed`` seeds the noise generators (one per replica
    and shard)."""

    enabled: bool = False
    nu: float = 0.01
    seed: int = 0


@dataclass
class WandbConfig:
    """Weights & Biases sink (global rank 0 only). ``mode`` ``None``: online when an API
    key is configured (``WANDB_API_KEY`` or ``wandb login``), else offline."""

    enabled: bool = False
    project: str = "hdet"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    mode: str | None = None
    dir: str | None = None


@dataclass
class LoggingConfig:
    """Metric sinks on global rank 0. ``jsonl``: path of the JSONL metrics file
    (``None``: none). ``every``: per-step records every this many optimizer steps."""

    jsonl: str | None = None
    every: int = 1
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class HDETConfig:
    """The ``"hdet"`` block of a DeepSpeed config.

    ``replicas``: R, the number of model replicas (the size of each replica group); the
    shard group size is ``world_size / R``. ``sync_interval``: T, optimizer steps between
    converges. ``gradient_sharing``: ``"global"`` (paper: every replica applies the
    gradient averaged over all ranks) or ``"replica"`` (gradients stay inside a replica
    between syncs). ``overlap_gradient_sharing``: on DeepSpeed ZeRO-3, start each
    gradient bucket's all-reduce over the replica group as the backward pass produces it
    (``backends/ds_overlap.py``) rather than after it; the same mean (bit for bit at
    R = 2). ``seed`` seeds the dedicated permutation generator.
    """

    enabled: bool = True
    replicas: int = 1
    sync_interval: int = 1000
    gradient_sharing: str = "global"
    overlap_gradient_sharing: bool = True
    seed: int = 0
    bucket_mb: float = 25.0
    axes: dict[str, AxisConfig] = field(default_factory=lambda: {"lr": AxisConfig()})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    auto: AutoConfig = field(default_factory=AutoConfig)
    warm_init: WarmInitConfig = field(default_factory=WarmInitConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str = "hdet") -> "HDETConfig":
        """Parse and validate a block. Raises HDETConfigError listing every problem."""
        errors: list[str] = []
        data = _resolve_auto(data, prefix, errors)
        cfg = _parse(cls, data, prefix, errors)
        # The LR follows the base schedule even when only another axis is explored.
        cfg.axes.setdefault("lr", AxisConfig())
        if cfg.enabled:  # a disabled block only has to be well-formed
            _validate(cfg, prefix, errors)
        if errors:
            raise HDETConfigError("invalid hdet config:\n  " + "\n  ".join(errors))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes: the flat-bucket size of converge and gradient sharing."""
        return int(self.bucket_mb * 2**20)

    def axis_auto(self, name: str) -> bool:
        axis = self.axes[name]
        return (name == "lr") if axis.auto is None else axis.auto

    @property
    def first_meta_step(self) -> int:
        """Optimizer step of the first auto-LR meta-update: the first sync at or after
        ``auto.warmup_steps`` (and at least the first sync). Needs ``sync_interval >= 1``."""
        T = self.sync_interval
        return max(math.ceil(self.auto.warmup_steps / T), 1) * T

    @property
    def auto_can_move(self) -> bool:
        """Auto-LR is on and some axis it controls has replicas to compare (R > 1 and a
        spread > 0); otherwise the meta-update has no signal."""
        return (self.auto.enabled and self.replicas > 1
                and any(self.axis_auto(n) and a.spread_ratio > 0 for n, a in self.axes.items()))

    @property
    def single_replica_warning(self) -> str | None:
        """A message when ``replicas`` is 1 but the block asks for what needs two or more
        (a spread, auto-LR): that one replica gets the spread's centre, converge has
        nothing to average and auto-LR nothing to compare, so the run is plain data
        parallelism. ``None`` otherwise (also for R = 1 without them: a deliberate
        baseline)."""
        if not self.enabled or self.replicas != 1:
            return None
        spread = sorted(f"axes.{n}.spread_ratio={a.spread_ratio:g}" for n, a in self.axes.items() if a.spread_ratio > 0)
        wants = spread + (["auto.enabled=true"] if self.auto.enabled else [])
        if not wants:
            return None
        return (f"hdet.replicas: 1 replica with {', '.join(wants)}: HDET does nothing (the one replica gets "
                "multiplier 1, converge has nothing to average, auto-LR nothing to compare): this is plain data "
                "parallelism. Set hdet.replicas >= 2 (it must divide the world size)")

    @property
    def auto_off_warning(self) -> str | None:
        """A message when an axis asks auto-LR to move it (``auto: true``) while
        ``auto.enabled`` is false: nothing moves it (tester round 20: said nothing)."""
        if not self.enabled or self.auto.enabled:
            return None
        asked = sorted(n for n, a in self.axes.items() if a.auto)
        if not asked:
            return None
        return (f"hdet.axes.{asked[0]}.auto: true has no effect while hdet.auto.enabled is false (auto-LR is off, "
                f"nothing moves {', '.join(asked)}); set hdet.auto.enabled=true, or leave the axis' auto out")

    @property
    def auto_without_spread_warning(self) -> str | None:
        """A message when auto-LR is on over two or more replicas but no axis it controls
        has a spread: every replica trains with the same values, so the hypergradient is 0
        and the multiplier stays 1 for the whole run. ``None`` otherwise: also for spread
        0 with ``auto.enabled=false`` (the documented plain data parallelism) and for one
        replica (:attr:`single_replica_warning` says it)."""
        if not self.enabled or not self.auto.enabled or self.replicas < 2:
            return None
        if self.auto_can_move:  # some axis moves; one asked to move without a spread cannot
            idle = sorted(n for n, a in self.axes.items() if a.auto and a.spread_ratio == 0)
            return (f"hdet.axes.{idle[0]}: auto is true but spread_ratio is 0: its replicas all run one value, so "
                    "auto-LR has no signal for it and its base never moves; set a spread_ratio > 0 or auto false"
                    ) if idle else None
        controlled = sorted(n for n in self.axes if self.axis_auto(n))
        spreads = ", ".join(f"axes.{n}.spread_ratio={self.axes[n].spread_ratio:g}" for n in controlled)
        which = f"no axis it controls has a spread ({spreads})" if controlled else \
            "it controls no axis (every axis has auto: false)"
        # tester round 19: "the replicas train with the same values" while another axis,
        # one auto-LR does not move, still spread them
        others = sorted(n for n, a in self.axes.items() if not self.axis_auto(n) and a.spread_ratio > 0)
        same = (f"the replicas differ only in {', '.join(others)}, which auto-LR does not move" if others else
                "the replicas train with the same values")
        plain = ("To keep exploring only those, set hdet.auto.enabled=false" if others else
                 "For plain data parallelism set hdet.auto.enabled=false")
        explore = ("to explore, set a spread_ratio > 0 on an axis it controls (e.g. hdet.axes.lr.spread_ratio=0.2)"
                   if controlled else  # tester round 20: advised a spread the lr axis already had
                   f"to let it move one, set auto: true on a spread axis (e.g. hdet.axes.{(others or ['lr'])[0]}.auto"
                   "=true)")
        return (f"hdet.auto.enabled: auto-LR is on, but {which}: {same}, so auto-LR has no signal and cannot move "
                f"anything (hypergradient 0, multiplier 1). {plain}; {explore}")

    @property
    def uses_probe(self) -> bool:
        """The auto-LR fitness is the probe loss and there is something to score."""
        return self.auto_can_move and self.auto.fitness == "probe"


def _type_ok(value: Any, annotation: str) -> bool:
    """Checks a JSON value against the (string) annotation of a field."""
    opts = [a.strip() for a in annotation.split("|")]
    for opt in opts:
        if opt == "None" and value is None:
            return True
        if opt == "bool" and isinstance(value, bool):
            return True
        if opt == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if opt == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if opt == "str" and isinstance(value, str):
            return True
        if opt.startswith("list[") and isinstance(value, (list, tuple)):
            inner = opt[5:-1]
            if all(_type_ok(v, inner) for v in value):
                return True
    return False


def _parse(cls: type, data: Any, prefix: str, errors: list[str]) -> Any:
    if not isinstance(data, Mapping):
        # JSON's words, not Python's ("got NoneType" for a null, tester round 17)
        got = "null" if data is None else f"{type(data).__name__} {data!r}"[:200]
        errors.append(f"{prefix}: expected an object, got {got}")
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            errors.append(f"{prefix}.{key}: unknown key; valid keys: {', '.join(fields)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            continue
        value, key = data[name], f"{prefix}.{name}"
        sub = {"schedule": ScheduleConfig, "auto": AutoConfig, "logging": LoggingConfig,
               "wandb": WandbConfig, "warm_init": WarmInitConfig}.get(name)
        if sub is not None and f.type in (sub.__name__, sub):
            kwargs[name] = _parse(sub, value, key, errors)
        elif name == "axes" and cls is HDETConfig:
            kwargs[name] = _parse_axes(value, key, errors)
        elif not _type_ok(value, str(f.type)):
            errors.append(f"{key}: expected {f.type}, got {value!r}")
        else:
            kwargs[name] = float(value) if str(f.type) == "float" else value
    return cls(**kwargs)


def _parse_axes(data: Any, prefix: str, errors: list[str]) -> dict[str, AxisConfig]:
    if not isinstance(data, Mapping):
        errors.append(f"{prefix}: expected an object mapping axis name to settings")
        return {}
    axes = {}
    for name, value in data.items():
        if name not in AXIS_NAMES:
            errors.append(f"{prefix}.{name}: unknown axis; valid axes: {', '.join(AXIS_NAMES)}")
            continue
        axes[name] = _parse(AxisConfig, value, f"{prefix}.{name}", errors)
    return axes


def _resolve_auto(data: Any, prefix: str, errors: list[str]) -> Any:
    """``"auto"`` values, as Accelerate's DeepSpeed integration fills them from the
    trainer: ``schedule.max_lr: "auto"`` is the optimizer's LR (as ``null``).
    ``schedule.total_steps: "auto"`` is filled by the trainer that knows the run's length
    (``hdet-train``: ``train.steps``; ``HDETTrainer``: the ``Trainer``'s optimizer steps)
    before the block gets here; reaching the library it is an error."""
    sched = data.get("schedule") if isinstance(data, Mapping) else None
    if not isinstance(sched, Mapping):
        return data
    sched = dict(sched)
    if sched.get("max_lr") == "auto":
        sched["max_lr"] = None
    if sched.get("total_steps") == "auto":
        errors.append(f"{prefix}.schedule.total_steps: 'auto' is the run's length, which hdet-train (train.steps) "
                      "and HDETTrainer (the Trainer's optimizer steps) fill in; here give the number of optimizer "
                      "steps")
        sched["total_steps"] = None
    return {**data, "schedule": sched}


#: The most optimizer steps a run may have: float64 holds every step count up to it exactly.
MAX_STEPS = 2 ** 53


def _phase_message(n: int, pc: float, three_phase: bool) -> str:
    """Why ``pct_start`` gives OneCycle a phase without steps, and the values that work
    for this run length (tester round 17: "phase ends [-0.6, 1]" for train.steps=2)."""
    high = (n + 1) / (2 * n) if three_phase else 1.0  # from the phase ends' order
    head = (f"{pc:g} x total_steps={n} gives OneCycle {pc * n:g} warm-up steps, a phase of zero or negative length "
            f"(it needs 1 < pct_start * total_steps"
            + (" and 2 * pct_start * total_steps - 1 < total_steps)" if three_phase else " < total_steps)"))
    if 1 / n < high:
        return f"{head}; with total_steps={n} pct_start must be in ({1 / n:.4g}, {high:.4g})"
    return f"{head}; no pct_start works with total_steps={n}: run longer, or use schedule.name constant or cosine"


def seed_ok(seed: object) -> bool:
    """A seed ``torch.manual_seed`` accepts (an integer in [-2**63, 2**64)); beyond, it
    raises on every rank after start-up (tester round 12)."""
    return isinstance(seed, int) and not isinstance(seed, bool) and -2 ** 63 <= seed < 2 ** 64


def _reported(errors: list[str], key: str) -> bool:
    """Whether ``key`` or a block above it already has an error in ``errors``."""
    parts = key.split(".")
    return any(e.startswith(tuple(".".join(parts[:i]) + ": " for i in range(1, len(parts) + 1))) for e in errors)


def _check(errors: list[str], ok: bool, key: str, message: str, reads: tuple[str, ...] = ()) -> None:
    # A key already reported, or its block (a wrong type: the default stands in), is not
    # judged again on the stand-in: "expected int, got 10.5" then "must be >= 1, got None"
    # would contradict itself. Nor is a check across keys when a key it also reads
    # (``reads``) was refused: sync_interval=5.0 drew a warmup_steps verdict computed with
    # the default sync_interval 1000, which the user never set (tester, issue 9).
    if not ok and not any(_reported(errors, k) for k in (key, *reads)):
        errors.append(f"{key}: {message}")


def _validate(cfg: HDETConfig, p: str, errors: list[str]) -> None:
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
        # tester round 12: a warm-up past the run's end never reached the peak (2e-5 of 3e-3)
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
    for name in ("dropout", "label_smoothing"):  # tester round 19: a bias, not a measure
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
        _check(errors, a.warmup_steps < s.total_steps, f"{k}.warmup_steps",
               f"must be shorter than the run (schedule.total_steps={s.total_steps}), got {a.warmup_steps}; "
               f"lower it or set {k}.enabled=false", reads=run_keys)
        first = cfg.first_meta_step if cfg.sync_interval >= 1 else 0
        _check(errors, first <= s.total_steps, f"{k}.warmup_steps",
               f"leaves no sync after warm-up: the first sync at or after warmup_steps ({a.warmup_steps}) is step "
               f"{first} (sync_interval {cfg.sync_interval}), past schedule.total_steps ({s.total_steps})",
               reads=(*run_keys, f"{p}.sync_interval"))
    lg = cfg.logging
    _check(errors, lg.every >= 1, f"{p}.logging.every", f"must be >= 1, got {lg.every}")
    _check(errors, lg.wandb.mode in (None, "online", "offline", "disabled"), f"{p}.logging.wandb.mode",
           f"must be null, 'online', 'offline' or 'disabled', got {lg.wandb.mode!r}")
