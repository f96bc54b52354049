"""``hdet-dryrun CONFIG.json --world-size W [--backend B]``: check an ``"hdet"`` block for a
world you do not have, in one CPU process, and print the replica x shard groups, the
fan-out multipliers and the derived auto-LR decay. ``--backend deepspeed`` (default) also
checks the DeepSpeed keys HDET depends on; ``fsdp2``, ``ddp`` and ``fairscale`` check what
that engine reads of the file as ``hdet-train`` does (``engines.check_engine_config``: a
torch optimizer and its arguments, no ``scheduler`` block, no fp16, bf16 with fsdp2 only)
and ignore the rest. Every backend also gets the checks ``hdet-train`` runs on the JSON:
unknown keys, blocks given as a value, and the optimizer values
(``ds_values.check_deepspeed_values``), each stage's errors in one message (a missing
``total_steps`` with the hdet block's; the stages: docs/config.md). The plan lists a few groups and counts the rest: the same time and
memory for any world size. ``--params`` / ``--hf-config`` add the cost model (memory and
bytes per rank, ``hdet_scale.cost``), ``--build-groups`` the real process groups on torch's
fake backend. Exit 0 when valid, 2 with the errors if not."""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import Any, Callable

from hdet_scale.backends import BACKENDS
from hdet_scale.dryrun_autos import auto_hints, trainer_autos_left_out
from hdet_scale.errors import HDETConfigError


INSIDE_REPLICA = {"deepspeed": "ZeRO-3 partitions parameters, gradients and optimizer state",
                  "fsdp2": "FSDP2 shards parameters, gradients and optimizer state",
                  "ddp": "every rank holds the full model and optimizer state",
                  "fairscale": "OSS shards the optimizer state; every rank holds the full model"}


# Groups, ranks and replicas printed one by one up to this many; beyond, the first few and
# the last: a plan for a million ranks is read, not scrolled (and printing it would take
# memory and time in proportion to the world).
_LISTED = 8
_HEAD = 3
# hdet.schedule.total_steps while checking a file that leaves it to the trainer.
_STAND_IN_TOTAL = 10**12
_MISSING_TOTAL = ("hdet.schedule.total_steps: must be an integer >= 1; the file leaves it to the trainer "
                  "(hdet-train sets it from train.steps, HDETTrainer from max_steps): pass --total-steps N (the "
                  "checks that depend on the run length were not run)")


def _set_on_hf_model(cfg: Any, cost: dict | None) -> bool:
    """With ``--hf-config``, find what the dropout / temperature axes set in that model
    (meta device), as the engine will (so that hdet-dryrun does not say 0 for patterns
    hdet-train refuses). True when checked. Raises HDETConfigError as the engine would."""
    if not cost or cost.get("hf_config") is None or not any(a in cfg.axes for a in ("dropout", "temperature")):
        return False
    from hdet_scale.cost import hf_model
    from hdet_scale.model_axes import setters

    setters(hf_model(cost["hf_config"])[0], cfg)
    return True


def _layout_error(replicas: object, world_size: int) -> str | None:
    """``topology.Layout``'s message for a ``replicas`` that does not divide the world,
    or ``None`` (a valid count, or not an integer: the block's check names that)."""
    from hdet_scale.topology import Layout

    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        return None
    try:
        Layout(world_size, replicas)
    except HDETConfigError as e:
        return str(e)
    return None


def _body(error: str | None) -> list[str]:
    """The lines of a checks' message, its own heading (``invalid hdet config:``) dropped."""
    lines = error.splitlines() if error else []
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    return [line.strip() for line in lines]


def _with_first(first: str, error: str | None) -> str:
    """One message: ``first`` (a problem with total_steps), then the lines of ``error``
    (the other checks' message, its own heading dropped): every error at once."""
    return "invalid config:\n  " + "\n  ".join([first] + _body(error))


def _listed(count: int, item: Callable[[int], str], gap: str) -> list[str]:
    """``item(i)`` for each ``i < count``; beyond :data:`_LISTED`, the first few, then
    ``gap`` formatted with the number left out, then the last."""
    if count <= _LISTED:
        return [item(i) for i in range(count)]
    return [item(i) for i in range(_HEAD)] + [gap.format(count - _HEAD - 1)] + [item(count - 1)]


def _ranks(first: int, stride: int, count: int) -> str:
    """The ranks ``first, first + stride, ...`` (``count`` of them), as a list or elided."""
    shown = _listed(count, lambda i: str(first + i * stride), "... {} more ...")
    return "[" + ", ".join(shown) + "]" + (f" ({count} ranks)" if count > _LISTED else "")


def layout_report(world_size: int, replicas: int) -> str:
    """The text of ``topology.Layout.describe`` (identical up to :data:`_LISTED` groups of
    :data:`_LISTED` ranks; elided beyond), in time and memory independent of the world size."""
    from hdet_scale.topology import LEGEND

    shards = world_size // replicas
    return "\n".join(
        [f"world {world_size} = {replicas} replicas x {shards} shards{LEGEND}"]
        + _listed(replicas, lambda r: f"  shard group   {r}: ranks {_ranks(r * shards, 1, shards)}",
                  "  ... {} more shard groups ...")
        + _listed(shards, lambda j: f"  replica group {j}: ranks {_ranks(j, shards, replicas)}",
                  "  ... {} more replica groups ..."))


def _offset(j: int, replicas: int) -> float:
    # axes.spread_offsets(replicas)[j], without the list of all R (tests compare the two).
    center = (replicas - 1) / 2
    return (j - center) / max(center, 0.5)


def _per_replica(replicas: int, value: Callable[[float], float]) -> str:
    """``value(offset_j)`` for each replica ``j``, rounded, as a list or elided."""
    shown = _listed(replicas, lambda j: repr(round(value(_offset(j, replicas)), 6)), "... {} more ...")
    return "[" + ", ".join(shown) + "]" + (f" ({replicas} replicas)" if replicas > _LISTED else "")


def _schedule_line(cfg: Any, config: dict, schedule: Any, autos: tuple[str, ...] | list[str] = ()) -> str:
    # the peak LR a run starts from, which nothing else prints
    from hdet_scale.engine_config import peak_lr
    from hdet_scale.schedules import summary

    peak, source = peak_lr(cfg, config)
    if isinstance(peak, list) and peak:
        peak, source = peak[0], source + "[0], parameter group 0"
    if not isinstance(peak, (int, float)) or isinstance(peak, bool):
        if source == "optimizer.params.lr" and source in autos:
            # not "the optimizer's default" for an "auto" the Trainer fills
            return (f"schedule {cfg.schedule.name}: peak LR \"auto\" (optimizer.params.lr): the Trainer's "
                    "learning_rate")
        return f"schedule {cfg.schedule.name}: peak LR is the optimizer's default (no {source} in the file)"
    return f"{summary(schedule, float(peak))} (peak from {source})"


def log_reach(step_size: float, momentum: float, updates: int, max_factor: float) -> float:
    """The largest ``|log m|`` the ``"log"`` controller reaches after ``updates``
    meta-updates from ``m = 1``, ``v = 0`` (``controller.log_update``): the
    hypergradient is in ``[-1, 1]`` (``controller.normalized_hypergradient``), so after
    ``k`` updates ``|v_k| <= 1 - beta^k`` and ``|log m| <= step_size * sum_{k=1..n}
    (1 - beta^k)``, reached with ``g = +1`` (or -1) at every update; clipped at
    ``log(max_factor)``. Closed form: ``sum = n - beta (1 - beta^n) / (1 - beta)``."""
    n = max(updates, 0)
    ramp = n - (momentum * (1.0 - momentum ** n) / (1.0 - momentum) if momentum > 0 else 0.0)
    return min(step_size * ramp, math.log(max_factor))


def _reach_line(cfg: Any, n_meta: int) -> str:
    """How far the ``"log"`` controller's multiplier can move the schedule within the run:
    the meta-updates at syncs before the last step (one at the last step, after the last
    optimizer step, changes no step of the run), with the velocity's momentum ramp
    (:func:`log_reach`) and the ``max_factor`` clip."""
    a, T, total = cfg.auto, cfg.sync_interval, cfg.schedule.total_steps
    in_run = max((total - 1 - cfg.first_meta_step) // T + 1, 0)  # syncs s < total
    if in_run == 0:
        return ("  the multiplier stays x1 of the schedule within the run: no meta-update before the last step"
                + (" (one at the last step changes no step)" if n_meta else ""))
    log_m = log_reach(a.resolved("step_size"), a.resolved("momentum"), in_run, a.max_factor)
    # auto.decay_moves: at a sync whose interval the schedule fell over the LR multiplier
    # only rises ("up") or stays ("hold"), so fewer meta-updates can lower it. A bound: the
    # ramp restarts after a held sync ("up" floors the velocity at 0), never grows faster.
    free, note = in_run, ""
    if a.decay_moves != "both" and "lr" in cfg.axes and cfg.axis_auto("lr"):
        from hdet_scale.autolr import build_schedule, interval_decayed

        schedule = build_schedule(cfg)
        free = sum(1 for k in range(in_run)
                   if not interval_decayed(schedule, cfg.first_meta_step + (k - 1) * T, cfg.first_meta_step + k * T))
        if free < in_run:
            what = ("only rises", "lower") if a.decay_moves == "up" else ("does not move", "move")
            note = (f"; during the schedule's decay it {what[0]} (auto.decay_moves {a.decay_moves}): {free} "
                    f"meta-update{'s' if free != 1 else ''} can {what[1]} it")
    down = log_reach(a.resolved("step_size"), a.resolved("momentum"), free, a.max_factor)
    up = down if a.decay_moves == "hold" else log_m
    bound = (f"held at max_factor {a.max_factor:g}" if up >= math.log(a.max_factor)
             else f"bound max_factor {a.max_factor:g}")
    return (f"  the multiplier can reach at most x{math.exp(up):.3g} / x{math.exp(-down):.3g} of the schedule "
            "within the run "
            f"(over the {in_run} meta-update{'s' if in_run != 1 else ''} before the last step, with momentum "
            f"{a.resolved('momentum')}; {bound}){note}")


def describe(config: str | dict, world_size: int, total_steps: int | None = None, backend: str = "deepspeed",
             cost: dict | None = None, build_groups: bool = False) -> str:
    """The dry-run report; ``total_steps`` fills ``hdet.schedule.total_steps`` when the
    config leaves it to the trainer; ``cost`` (from ``cost.check_options``, non-empty)
    appends the cost model, ``build_groups`` the fake-backend build of the process groups
    (``hdet_scale.cost``). Raises HDETConfigError on an invalid config or an unknown
    ``backend``."""
    if backend not in BACKENDS:
        raise HDETConfigError(f"--backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if world_size < 1:
        raise HDETConfigError(f"--world-size: must be >= 1 (ranks), got {world_size}")
    from hdet_scale.backends.deepspeed import prepare_config
    from hdet_scale.backends.ds_prepare import read_for_check

    path = config
    config = read_for_check(config)
    if not isinstance(config, dict):
        raise HDETConfigError(f"the config must be a JSON object, got {type(config).__name__}")
    # Strict, unlike the library (see hdet_scale.ds_keys): a dry run exists to find what
    # a 30-hour run would silently ignore, such as an "hdett" block or a misspelled key.
    from hdet_scale.ds_keys import check_deepspeed_keys, hf_model_type
    from hdet_scale.ds_values import check_deepspeed_values

    if isinstance(path, str) and hf_model_type(config) is not None:
        raise HDETConfigError(f"{path!r} is a Hugging Face model config (model_type {hf_model_type(config)!r}), not "
                              f"a DeepSpeed config: give it as --hf-config {path} (the cost model), and the DeepSpeed "
                              "JSON with the hdet block as the first argument")

    check_deepspeed_keys(config, strict=True, optimizer_params=backend == "deepspeed")
    config, autos = trainer_autos_left_out(config)
    if not isinstance(config.get("hdet", {}), dict):
        raise HDETConfigError(f"hdet: expected an object, got {config['hdet']!r}")
    # The values hdet-train refuses before any rank starts (a negative, NaN or text LR, a
    # batch size < 1 or not matching the world): the trainer's engines read them whatever the backend.
    check_deepspeed_values(config, world_size=world_size)
    if backend != "deepspeed":
        # What hdet-train refuses for this engine (a Lamb optimizer, SGD given betas, fp16):
        # the trainer's own check, so the two cannot drift apart.
        from hdet_scale.train.engines import check_engine_config

        check_engine_config(config, backend, world_size, prefix="", title="invalid config")
        from hdet_scale.train.engines import engine_notes

        for note in engine_notes(config, backend, prefix=""):
            print(f"hdet-dryrun: note: {note}", file=sys.stderr, flush=True)
    if "hdet" not in config:
        if backend == "deepspeed":
            return "no hdet block: plain DeepSpeed"
        raise HDETConfigError(f"hdet: the config has no hdet block (the {backend} backend runs HDET only)")
    sched = config["hdet"].setdefault("schedule", {})
    if not isinstance(sched, dict):
        raise HDETConfigError(f"hdet.schedule: expected an object, got {sched!r}")
    first = None  # a total_steps problem, reported first with every other error
    if total_steps is not None:
        in_file = sched.get("total_steps")
        if in_file in (None, "auto"):  # left to the trainer, as --total-steps stands for
            sched["total_steps"] = total_steps
        elif isinstance(in_file, int) and not isinstance(in_file, bool) and in_file < total_steps:
            first = (f"--total-steps {total_steps} is longer than hdet.schedule.total_steps={in_file} in the "
                     "file: the schedule must cover the run (HDETTrainer and hdet-train refuse it)")
        elif isinstance(in_file, int) and not isinstance(in_file, bool) and in_file > total_steps:
            # not refused, since HDETTrainer (max_steps) and hdet-train (train.steps)
            # run the schedule's first steps with a warning
            print(f"hdet-dryrun: note: --total-steps {total_steps} < hdet.schedule.total_steps={in_file}: the run "
                  f"covers the schedule's first {total_steps} steps and ends before its LR anneals (a run to be "
                  "resumed up to its end); the report shows the whole schedule", file=sys.stderr, flush=True)
        # else the same number, or a value of the wrong type ("100"), which the block's own
        # check names (not "--total-steps 100 differs from ...=100")
    from hdet_scale.autolr import build_schedule, decay_for, drowning_warning

    # A file that leaves total_steps to the trainer is checked with a stand-in run length
    # too long for any check to fail on, so that its other errors show in the same message.
    if sched.get("total_steps") in (None, "auto"):  # "auto": HDETTrainer's; it too needs --total-steps named
        first = _MISSING_TOTAL
        sched["total_steps"] = _STAND_IN_TOTAL
    with warnings.catch_warnings():
        # Reported below as a line of the report, not twice.
        warnings.filterwarnings("ignore", message="hdet.replicas: 1 replica")
        warnings.filterwarnings("ignore", message="hdet.auto.enabled: auto-LR is on, but")
        warnings.filterwarnings("ignore", message=r"hdet\.axes\.\w+: auto is true but spread_ratio is 0")
        warnings.filterwarnings("ignore", message=r"hdet\.axes\.\w+\.auto: true has no effect")
        warnings.filterwarnings("ignore", message=r"hdet\.schedule: schedule\.name '")
        try:
            if backend == "deepspeed":
                cfg, ds = prepare_config(config, world_size=world_size)
                if not cfg.enabled:
                    return "hdet.enabled is false: plain DeepSpeed"
            else:
                from hdet_scale.backends.common import resolve_config

                cfg = resolve_config(config, world_size)
        except HDETConfigError as e:
            # the layout and the optimizer-side axes are checked after the block's values:
            # said with them, not once they are fixed
            from hdet_scale.engine_config import optimizer_axis_errors

            lines = _body(str(e))
            pre = [first] if first is not None else []
            layout = _layout_error(config["hdet"].get("replicas"), world_size)
            if layout is not None and "hdet.replicas:" not in str(e):
                pre.append(layout)
            extra = [line for line in optimizer_axis_errors(config["hdet"], config, backend, prefix="hdet")
                     if line not in lines]
            if not pre and not extra:
                raise
            raise HDETConfigError("invalid config:\n  " + "\n  ".join(pre + lines + extra)) from None
    if first is not None:  # with the checks that come after the block's
        from hdet_scale.engine_config import optimizer_axis_errors

        extra = optimizer_axis_errors(config["hdet"], config, backend, prefix="hdet")
        raise HDETConfigError("\n  ".join([_with_first(first, None), *extra]))
    from hdet_scale.autolr import check_additive_floors
    from hdet_scale.train.engines import axis_bases

    from hdet_scale.engine_config import check_optimizer_axes

    check_optimizer_axes(cfg, config, prefix="hdet")
    check_additive_floors(cfg, build_schedule(cfg), axis_bases(cfg, config, backend))  # hdet-train's check
    lines = [layout_report(world_size, cfg.replicas)]
    for warning in (cfg.single_replica_warning, cfg.auto_without_spread_warning, cfg.auto_off_warning,
                    cfg.schedule_unused_warning):
        if warning:
            lines.append(f"warning: {warning}")
    total = cfg.schedule.total_steps
    if cfg.sync_interval > total:  # as hdet-train's notes
        lines.append(f"note: hdet.sync_interval={cfg.sync_interval} > total_steps={total}: no sync during the run "
                     "(no auto-LR step; the replicas are averaged only by the final converge at the run's last step)")
    if cfg.logging.every > total:
        lines.append(f"note: hdet.logging.every={cfg.logging.every} > total_steps={total}: one per-step record, the last step's")
    lines.append(f"{backend}, inside each replica (shard group of {world_size // cfg.replicas} ranks): "
                 f"{INSIDE_REPLICA[backend]}")
    if backend == "deepspeed":
        lines.append(f"DeepSpeed train_batch_size per replica: "
                     f"{ds.get('train_batch_size', 'from micro x accumulation')}")
    schedule = build_schedule(cfg)
    on_model = _set_on_hf_model(cfg, cost)
    for name, axis in sorted(cfg.axes.items()):
        if axis.kind == "multiplicative":
            lines.append(f"axis {name}: multipliers {_per_replica(cfg.replicas, lambda o: 1.0 + axis.spread_ratio * o)}")
        else:
            lines.append(f"axis {name}: offsets {_per_replica(cfg.replicas, lambda o: axis.spread_ratio * o)}")
        if axis.spread_ratio == 0:  # not listed as multipliers [1.0, 1.0] without a word
            lines[-1] += " (spread_ratio 0: not explored, every replica runs one value)"
        # what needs the model or the optimizer is the engine's to check
        if getattr(axis, "modules", None) and on_model:
            lines.append(f"  modules {list(axis.modules)}: each matches modules the axis sets in --hf-config's model")
        elif getattr(axis, "modules", None):
            lines.append(f"  modules {list(axis.modules)}: matched against the model's module names when the engine "
                         "binds the model (hdet-dryrun has no model: --hf-config checks them)")
        if getattr(axis, "groups", None):
            lines.append(f"  groups {list(axis.groups)}: checked against the optimizer's parameter groups when the "
                         "engine starts (hdet-dryrun has no optimizer)")
        if cfg.auto.enabled and cfg.axis_auto(name) and cfg.auto.controller == "paper":
            gamma = decay_for(cfg, schedule, name, 1.0)
            lines.append(f"  auto-LR decay gamma per sync: {gamma:.6g}")
            warn = drowning_warning(cfg, gamma) if name == "lr" else None
            if warn:
                lines.append(f"  warning: {warn}")
    lines.append(_schedule_line(cfg, config, schedule, autos))
    lines.append(f"sync every {cfg.sync_interval} optimizer steps; gradient sharing: {cfg.gradient_sharing}")
    a = cfg.auto
    if a.enabled and not cfg.auto_can_move:  # no meta-update count or reach: nothing would move (warning above)
        lines.append(f"auto-LR: on (controller {a.controller}), but it cannot move anything in this run: no axis it "
                     "controls has a spread over two or more replicas")
    elif a.enabled:
        T, total = cfg.sync_interval, cfg.schedule.total_steps
        n_meta = max((total - cfg.first_meta_step) // T + 1, 0)
        lines.append(f"auto-LR: controller {a.controller}, fitness {a.fitness}, groups {a.groups}, "
                     f"temperature {a.resolved('temperature')}, momentum {a.resolved('momentum')}, "
                     f"step_size {a.resolved('step_size')}; {n_meta} meta-update{'s' if n_meta != 1 else ''} (first at step "
                     f"{cfg.first_meta_step})")
        if a.controller == "log":
            lines.append(_reach_line(cfg, n_meta))
        if a.fitness == "probe":
            lines.append("  fitness: probe batches, evaluated by every rank at each auto-LR sync "
                         "(pass probe= to initialize)")
    if cfg.warm_init.enabled:
        lines.append(f"warm init: noise std nu={cfg.warm_init.nu:g} x RMS of the whole model, per replica")
    if build_groups or cost:
        from hdet_scale import cost as cost_model
        from hdet_scale.cost_report import dryrun_section

        if build_groups:
            lines.append(cost_model.groups_line(world_size, cfg.replicas))
        if cost:
            lines.append(dryrun_section(cfg, config, backend, world_size, cost, autos))
    return "\n".join(lines)


class _Once(argparse.Action):
    """Store an option's value, refusing a second occurrence: argparse would keep the last
    one, so ``--total-steps 100 ... --total-steps 10`` would check a run the user did not
    mean, without a word."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_seen_{self.dest}", False):
            parser.error(f"{option_string} given twice: give it once")
        setattr(namespace, f"_seen_{self.dest}", True)
        setattr(namespace, self.dest, values)


def _attach_dash_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--opt -7B`` as ``--opt=-7B``: argparse takes a value starting with ``-`` that is no
    plain negative number for an option and says "expected one argument" (e.g.
    ``--params -7B``), where the tool's own range check names the value. Only after an
    option that takes a value, and only a token that is none of the parser's options."""
    takes_value = {o for a in parser._actions if a.nargs is None and a.option_strings for o in a.option_strings}
    known = {o for a in parser._actions for o in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if tok in takes_value and nxt is not None and nxt.startswith("-") and nxt not in known and nxt != "--":
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hdet-dryrun", description=__doc__)
    from hdet_scale import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s (hdet_scale) {__version__}")
    p.add_argument("config", help="DeepSpeed JSON with an 'hdet' block")
    p.add_argument("--backend", default="deepspeed", choices=BACKENDS, action=_Once,
                   help="training engine (default: deepspeed)")
    p.add_argument("--world-size", type=int, required=True, action=_Once, help="total number of ranks W")
    p.add_argument("--total-steps", type=int, default=None, action=_Once,
                   help="optimizer steps of the run, when hdet.schedule.total_steps is not in the file")
    # The cost model (hdet_scale/cost.py); values are checked there, so a bad one is one line naming it.
    p.add_argument("--params", "--model-params", action=_Once, help="model size for the cost model: 7e9, 7B, 125M")
    p.add_argument("--hf-config", action=_Once, help="or a Hugging Face config.json (built on the meta device)")
    p.add_argument("--precision", action=_Once, help="fp32 or bf16 (fp32 masters); default: the file's bf16.enabled")
    p.add_argument("--bandwidth-gbps", action=_Once, help="each rank's link, Gbit/s: time of every transfer")
    p.add_argument("--step-seconds", action=_Once, help="an optimizer step's time: each transfer's share of it")
    p.add_argument("--build-groups", action="store_true",
                   help="build rank 0's real process groups on torch's fake backend (worlds up to 2^18)")
    args = p.parse_args(_attach_dash_values(sys.argv[1:] if argv is None else argv, p))
    if args.total_steps is not None and args.total_steps < 1:  # alone: no verdicts on values derived from it
        p.error(f"--total-steps: must be an integer >= 1 (optimizer steps of the run), got {args.total_steps}")
    try:
        from hdet_scale.cost import check_options

        cost = check_options(args.params, args.hf_config, args.precision, args.bandwidth_gbps, args.step_seconds)
        print(describe(args.config, args.world_size, args.total_steps, args.backend, cost, args.build_groups))
    except HDETConfigError as e:
        print(f"hdet-dryrun: error: {e}{auto_hints(args.config, str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
