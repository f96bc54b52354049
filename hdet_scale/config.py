"""Typed configuration of the DeepSpeed ``"hdet"`` block, validated before any collective.

Every key is documented in docs/config.md. Parsing is pure (no ``torch.distributed``), so
all ranks reach the same verdict from the same JSON and a bad value fails fast on every
rank. All problems found in one block are reported together in one
:class:`~hdet_scale.errors.HDETConfigError`, each naming its dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from hdet_scale.axis_specs import AXIS_NAMES
from hdet_scale.config_checks import validate as _validate
from hdet_scale.errors import HDETConfigError



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


#: The schedule keys each ``schedule.name`` reads beyond ``name``, ``total_steps`` and ``max_lr``.
#: The smallest hdet block that searches something: the example of the refusals of a
#: config without one (hdet-train and the library say it alike).
BLOCK_EXAMPLE = '"hdet": {"replicas": 2, "sync_interval": 10, "axes": {"lr": {"spread_ratio": 0.2}}}'

SCHEDULE_READS = {"onecycle": frozenset({"pct_start", "anneal_strategy", "div_factor", "final_div_factor",
                                         "three_phase", "cycle_momentum"}),
                  "cosine": frozenset({"warmup_steps", "min_ratio"}),
                  "constant": frozenset({"warmup_steps"})}
#: Each schedule-specific key and whose it is (the momentum pair: only with cycle_momentum).
_SCHEDULE_ONLY = {**{k: "onecycle" for k in SCHEDULE_READS["onecycle"] - {"cycle_momentum"}},
                  "base_momentum": "onecycle with cycle_momentum true", "max_momentum": "onecycle with cycle_momentum true",
                  "warmup_steps": "cosine, constant", "min_ratio": "cosine"}


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
    ``min(schedule floor, peak / max_factor)``. ``noise_scale``: with ``temperature``
    ``"auto"`` and a probe that returns per-example losses, the temperature is
    ``sqrt(std(fitness)^2 + (noise_scale * noise)^2)`` with ``noise`` the standard error
    of the replicas' fitness gaps (``controller.fitness_noise``), so a gap inside the
    noise moves the multiplier by little; 0 ignores the noise (z-scores alone).
    ``decay_moves``: what the ``"log"`` controller may do to the LR multiplier at a sync
    whose interval the schedule decayed over: ``"up"`` (default) only raise it, ``"hold"``
    leave it, ``"both"`` move it either way. Over one interval a smaller step nearly always
    lowers the loss sooner (short-horizon bias): during the decay the comparison then
    lowers the multiplier whatever the best LR of the whole run, while a raise happens
    against that bias and is kept (docs/quality.md, longer runs). A schedule that never
    decays (``"constant"``) is not affected; other axes are not affected. ``None`` values
    take the controller's default (:data:`CONTROLLER_DEFAULTS`).
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
    noise_scale: float = 3.0
    decay_moves: str = "up"

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
    key is configured (``WANDB_API_KEY`` or ``wandb login``), else offline. ``project``
    ``None``: ``WANDB_PROJECT`` from the environment, else ``"hdet"`` (entity, group and
    name ``None``: W&B reads ``WANDB_ENTITY``, ``WANDB_RUN_GROUP``, ``WANDB_NAME``)."""

    enabled: bool = False
    project: str | None = None
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
        # "~" as a shell expands it, as hdet-train does for its paths (else the library
        # writes hdet.logging.jsonl "~/m.jsonl" into a folder named "~" here)
        log = getattr(cfg, "logging", None)
        if isinstance(getattr(log, "jsonl", None), str):
            log.jsonl = os.path.expanduser(log.jsonl)
        if isinstance(getattr(getattr(log, "wandb", None), "dir", None), str):
            log.wandb.dir = os.path.expanduser(log.wandb.dir)
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
        ``auto.enabled`` is false: nothing moves it, and nothing else would say so."""
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
        # not "the replicas train with the same values" while another axis, one auto-LR
        # does not move, still spreads them
        others = sorted(n for n, a in self.axes.items() if not self.axis_auto(n) and a.spread_ratio > 0)
        same = (f"the replicas differ only in {', '.join(others)}, which auto-LR does not move" if others else
                "the replicas train with the same values")
        plain = ("To keep exploring only those, set hdet.auto.enabled=false" if others else
                 "For plain data parallelism set hdet.auto.enabled=false")
        explore = ("to explore, set a spread_ratio > 0 on an axis it controls (e.g. hdet.axes.lr.spread_ratio=0.2)"
                   if controlled else  # never advise a spread the lr axis already has
                   f"to let it move one, set auto: true on a spread axis (e.g. hdet.axes.{(others or ['lr'])[0]}.auto"
                   "=true)")
        return (f"hdet.auto.enabled: auto-LR is on, but {which}: {same}, so auto-LR has no signal and cannot move "
                f"anything (hypergradient 0, multiplier 1). {plain}; {explore}")

    @property
    def schedule_unused_warning(self) -> str | None:
        """A message naming the ``schedule`` keys set to a value other than their default
        that ``schedule.name`` does not read (``name: cosine`` over a OneCycle block would drop its
        ``pct_start`` warm-up without a word), or ``None``."""
        s = self.schedule
        if not self.enabled or s.name not in SCHEDULE_READS:
            return None
        reads = SCHEDULE_READS[s.name] | ({"base_momentum", "max_momentum"} if s.cycle_momentum else set())
        # cycle_momentum itself: true off onecycle is an error, false is off everywhere
        # a value other than the default: set on purpose (a to_dict() round trip lists them all)
        default = ScheduleConfig()
        unused = sorted(k for k in _SCHEDULE_ONLY if k not in reads and getattr(s, k) != getattr(default, k))
        if not unused:
            return None
        unread = ", ".join(f"{k}={getattr(s, k)!r} ({_SCHEDULE_ONLY[k]})" for k in unused)
        read = ", ".join(f"{k}={getattr(s, k)!r}" for k in sorted(SCHEDULE_READS[s.name]))
        return (f"hdet.schedule: schedule.name '{s.name}' does not read {unread}; it reads {read}. Remove them, or "
                "set the schedule they belong to")

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
        # JSON's words, not Python's ("got NoneType" for a null)
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
