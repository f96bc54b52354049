"""``hdet-dryrun CONFIG.json --world-size W [--backend B]``: check an ``"hdet"`` block for a
world you do not have, in one CPU process, and print the replica x shard groups, the
fan-out multipliers and the derived auto-LR decay. ``--backend deepspeed`` (default) also
checks the DeepSpeed keys HDET depends on; ``fsdp2``, ``ddp`` and ``fairscale`` check the
``hdet`` block alone. Every backend also gets the checks ``hdet-train`` runs on the JSON:
unknown keys, blocks given as a value, and the optimizer values
(``ds_values.check_deepspeed_values``). Exit 0 when valid, 2 with the errors if not."""

from __future__ import annotations

import argparse
import math
import sys
import warnings

from hdet_scale import axes as ax
from hdet_scale.backends import BACKENDS
from hdet_scale.errors import HDETConfigError


INSIDE_REPLICA = {"deepspeed": "ZeRO-3 partitions parameters, gradients and optimizer state",
                  "fsdp2": "FSDP2 shards parameters, gradients and optimizer state",
                  "ddp": "every rank holds the full model and optimizer state",
                  "fairscale": "OSS shards the optimizer state; every rank holds the full model"}


def describe(config: str | dict, world_size: int, total_steps: int | None = None, backend: str = "deepspeed") -> str:
    """The dry-run report; ``total_steps`` fills ``hdet.schedule.total_steps`` when the
    config leaves it to the trainer. Raises HDETConfigError on an invalid config or an
    unknown ``backend``."""
    if backend not in BACKENDS:
        raise HDETConfigError(f"--backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if world_size < 1:
        raise HDETConfigError(f"--world-size: must be >= 1 (ranks), got {world_size}")
    from hdet_scale.backends.deepspeed import _load_ds_config, prepare_config

    try:
        config = _load_ds_config(config)
    except (OSError, ValueError, TypeError) as e:
        raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: {e}") from None
    if not isinstance(config, dict):
        raise HDETConfigError(f"the config must be a JSON object, got {type(config).__name__}")
    # Strict, unlike the library (see hdet_scale.ds_keys): a dry run exists to find what
    # a 30-hour run would silently ignore, such as an "hdett" block or a misspelled key.
    from hdet_scale.ds_keys import check_deepspeed_keys
    from hdet_scale.ds_values import check_deepspeed_values

    check_deepspeed_keys(config, strict=True, optimizer_params=backend == "deepspeed")
    if not isinstance(config.get("hdet", {}), dict):
        raise HDETConfigError(f"hdet: expected an object, got {config['hdet']!r}")
    # The values hdet-train refuses before any rank starts (a negative, NaN or text LR):
    # the trainer's engines read them whatever the backend.
    check_deepspeed_values(config)
    if "hdet" not in config:
        if backend == "deepspeed":
            return "no hdet block: plain DeepSpeed"
        raise HDETConfigError(f"hdet: the config has no hdet block (the {backend} backend runs HDET only)")
    sched = config["hdet"].setdefault("schedule", {})
    if not isinstance(sched, dict):
        raise HDETConfigError(f"hdet.schedule: expected an object, got {sched!r}")
    if total_steps is not None:
        if sched.get("total_steps") not in (None, total_steps):
            raise HDETConfigError(f"--total-steps {total_steps} differs from hdet.schedule.total_steps="
                                  f"{sched['total_steps']} in the file")
        sched["total_steps"] = total_steps
    from hdet_scale.autolr import build_schedule, decay_for, drowning_warning
    from hdet_scale.topology import Layout

    with warnings.catch_warnings():
        # Reported below as a line of the report, not twice.
        warnings.filterwarnings("ignore", message="hdet.replicas: 1 replica")
        try:
            if backend == "deepspeed":
                cfg, ds = prepare_config(config, world_size=world_size)
                if not cfg.enabled:
                    return "hdet.enabled is false: plain DeepSpeed"
            else:
                from hdet_scale.backends.common import resolve_config

                cfg = resolve_config(config, world_size)
        except HDETConfigError as e:
            if sched.get("total_steps") is None and "schedule.total_steps" in str(e):
                raise HDETConfigError(f"{e}\n  (hdet.schedule.total_steps is left to the trainer in this file: "
                                      "pass --total-steps)") from None
            raise
    lines = [Layout(world_size, cfg.replicas).describe()]
    if cfg.single_replica_warning:
        lines.append(f"warning: {cfg.single_replica_warning}")
    lines.append(f"{backend}, inside each replica (shard group of {world_size // cfg.replicas} ranks): "
                 f"{INSIDE_REPLICA[backend]}")
    if backend == "deepspeed":
        lines.append(f"DeepSpeed train_batch_size per replica: "
                     f"{ds.get('train_batch_size', 'from micro x accumulation')}")
    schedule = build_schedule(cfg)
    for name, axis in sorted(cfg.axes.items()):
        if axis.kind == "multiplicative":
            mult = ax.multipliers(cfg.replicas, axis.spread_ratio)
            lines.append(f"axis {name}: multipliers {[round(m, 6) for m in mult]}")
        else:
            off = [axis.spread_ratio * o for o in ax.spread_offsets(cfg.replicas)]
            lines.append(f"axis {name}: offsets {[round(o, 6) for o in off]}")
        if cfg.auto.enabled and cfg.axis_auto(name) and cfg.auto.controller == "paper":
            gamma = decay_for(cfg, schedule, name, 1.0)
            lines.append(f"  auto-LR decay gamma per sync: {gamma:.6g}")
            warn = drowning_warning(cfg, gamma) if name == "lr" else None
            if warn:
                lines.append(f"  warning: {warn}")
    lines.append(f"sync every {cfg.sync_interval} optimizer steps; gradient sharing: {cfg.gradient_sharing}")
    a = cfg.auto
    if a.enabled:
        T, total = cfg.sync_interval, cfg.schedule.total_steps
        n_meta = max((total - cfg.first_meta_step) // T + 1, 0)
        lines.append(f"auto-LR: controller {a.controller}, fitness {a.fitness}, groups {a.groups}, "
                     f"temperature {a.resolved('temperature')}, momentum {a.resolved('momentum')}, "
                     f"step_size {a.resolved('step_size')}; {n_meta} meta-updates (first at step "
                     f"{cfg.first_meta_step})")
        if a.controller == "log":
            reach = math.exp(min(n_meta * a.resolved("step_size"), math.log(a.max_factor)))
            lines.append(f"  the multiplier can reach at most x{reach:.3g} / x{1 / reach:.3g} of the schedule "
                         f"(bound max_factor {a.max_factor:g})")
        if a.fitness == "probe":
            lines.append("  fitness: probe batches, evaluated by every rank at each auto-LR sync "
                         "(pass probe= to initialize)")
    if cfg.warm_init.enabled:
        lines.append(f"warm init: noise std nu={cfg.warm_init.nu:g} x RMS of the whole model, per replica")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hdet-dryrun", description=__doc__)
    p.add_argument("config", help="DeepSpeed JSON with an 'hdet' block")
    p.add_argument("--backend", default="deepspeed", choices=BACKENDS, help="training engine (default: deepspeed)")
    p.add_argument("--world-size", type=int, required=True, help="total number of ranks W")
    p.add_argument("--total-steps", type=int, default=None,
                   help="optimizer steps of the run, when hdet.schedule.total_steps is not in the file")
    args = p.parse_args(argv)
    try:
        print(describe(args.config, args.world_size, args.total_steps, args.backend))
    except HDETConfigError as e:
        print(f"hdet-dryrun: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
