"""Notes hdet-train prints before any rank starts, for settings that are valid but act
otherwise than a user likely meant: a setting that never acts within ``train.steps``, a
block that trains plain data parallelism, an auto-LR probe that costs more than the
training it steers, a value read otherwise than given. A note never stops a run (exit
codes: ``train/cli.py``)."""

from __future__ import annotations

import os

from hdet_scale.config import HDETConfig
from hdet_scale.ds_values import batch_sizes


def never_notes(run: dict) -> list[str]:
    """Settings that never act in a run of ``train.steps`` steps (nothing else says
    so): a sync interval, checkpoint cadence or logging cadence longer than the run, a
    schedule longer than the run (it never anneals); an auto-LR probe that reads more
    micro-batches at each sync than the ranks train between syncs (:func:`probe_note`); a
    data.path that names one file or folder twice (:func:`repeated_data_note`); values that
    are not read as given (:func:`unread_notes`).

    Args:
        run: the validated run config (``train.config.load_run_config``).

    Returns:
        One line per note, without the ``hdet-train: note:`` prefix; ``[]`` when the
        ``hdet`` block cannot be read (it was validated already: a note never fails a run).
    """
    steps, hdet = run["train"]["steps"], run["deepspeed"].get("hdet") or {}
    notes = []
    try:  # validated already; the defaults the block leaves out count too
        cfg = HDETConfig.from_dict(hdet)
    except Exception:  # noqa: BLE001 - a note is never worth failing a validated run
        return notes
    default = "" if "sync_interval" in hdet else " (the default)"
    if cfg.replicas > 1 and cfg.sync_interval > steps:
        notes.append(f"deepspeed.hdet.sync_interval={cfg.sync_interval}{default} > train.steps={steps}: no sync "
                     "during the run (no auto-LR step, the replicas are averaged only by the final converge)")
    if cfg.replicas > 1 and not any(a.spread_ratio for a in cfg.axes.values()):
        notes.append(f"deepspeed.hdet: {cfg.replicas} replicas but no axis has a spread (axes.<name>."
                     "spread_ratio, e.g. deepspeed.hdet.axes.lr.spread_ratio=0.2): they train with the same "
                     "hyperparameters, averaged every sync_interval steps, and nothing is searched")
    sched = hdet.get("schedule") if isinstance(hdet, dict) else None
    total = sched.get("total_steps") if isinstance(sched, dict) else None
    if isinstance(total, int) and not isinstance(total, bool) and total > steps:  # config.py filled and checked it
        notes.append(f"deepspeed.hdet.schedule.total_steps={total} > train.steps={steps}: the run covers the "
                     f"schedule's first {steps} steps only and ends before its LR anneals (leave total_steps out, "
                     "or set it to train.steps, to run the whole schedule)")
    every = run["train"].get("checkpoint_every")
    if isinstance(every, int) and every >= steps:
        notes.append(f"train.checkpoint_every={every} >= train.steps={steps}: no checkpoint before the end of the run")
    opt = run["deepspeed"].get("optimizer") if isinstance(run["deepspeed"].get("optimizer"), dict) else {}
    warm = (opt.get("params") or {}).get("warmup_steps") if isinstance(opt.get("params"), dict) else None
    if isinstance(warm, int) and not isinstance(warm, bool) and warm >= steps:
        # schedule-free AdamW's own linear warm-up (the packaged job's 60 steps)
        notes.append(f"deepspeed.optimizer.params.warmup_steps={warm} >= train.steps={steps}: the optimizer's "
                     "warm-up never ends, so the LR never reaches its peak (set it to about a fifth of train.steps)")
    log_every = ((hdet.get("logging") or {}).get("every") if isinstance(hdet, dict) else None)
    if isinstance(log_every, int) and log_every > steps:
        notes.append(f"deepspeed.hdet.logging.every={log_every} > train.steps={steps}: metrics.jsonl gets one per-step "
                     "record, the last step's (and the syncs' records)")
    return notes + probe_note(run, cfg) + repeated_data_note(run) + unread_notes(run, cfg) + off_notes(run, cfg)


def off_notes(run: dict, cfg: HDETConfig) -> list[str]:
    """Settings of something the run does not do (each is otherwise silent):
    ``auto.*`` with auto-LR off, ``warm_init.*`` with warm init off, ``train.keep_checkpoints``
    without ``train.checkpoint_every`` (the run saves one checkpoint, at its end), and
    ``overlap_gradient_sharing=false`` / ``model.sharded_init=false`` on a backend that
    does not read them. A value counts as set when it differs from both the default and the
    packaged deepspeed.json's (a copy of that file, or its block left as it is, says
    nothing)."""
    import dataclasses
    import json

    from hdet_scale.config import AutoConfig, WarmInitConfig
    from hdet_scale.train.config import TrainConfig, packaged

    hdet = run["deepspeed"].get("hdet") or {}
    with open(packaged("deepspeed.json")) as f:
        shipped = json.load(f)["hdet"]
    notes = []
    for block, fields, on in (("auto", AutoConfig, cfg.auto.enabled), ("warm_init", WarmInitConfig,
                                                                       cfg.warm_init.enabled)):
        given = hdet.get(block) if isinstance(hdet.get(block), dict) else {}
        defaults = {f.name: f.default for f in dataclasses.fields(fields)}
        unused = [f"deepspeed.hdet.{block}.{k}={v}" for k, v in sorted(given.items())
                  if k != "enabled" and k in defaults and v != defaults[k] and v != (shipped.get(block) or {}).get(k)]
        if not on and unused:
            notes.append(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect: "
                         f"deepspeed.hdet.{block}.enabled is false (set it to true to use "
                         f"{'it' if len(unused) == 1 else 'them'})")
    if cfg.warm_init.enabled and cfg.warm_init.nu == 0:  # allowed, and does nothing
        notes.append("deepspeed.hdet.warm_init.nu=0 adds no noise: warm init with it on changes nothing (the replicas "
                     "start equal, as with warm_init.enabled=false); the paper uses nu=0.01")
    t = run["train"]
    if t["keep_checkpoints"] != TrainConfig.keep_checkpoints and not t["checkpoint"]:
        # checkpoint_every > 0 with checkpoint=false is refused
        notes.append(f"train.keep_checkpoints={t['keep_checkpoints']} has no effect: train.checkpoint=false saves no "
                     "checkpoint")
    elif t["keep_checkpoints"] != TrainConfig.keep_checkpoints and not t.get("checkpoint_every"):
        notes.append(f"train.keep_checkpoints={t['keep_checkpoints']} has no effect: without train.checkpoint_every "
                     "the run saves one checkpoint, at its end (set train.checkpoint_every=N to save every N steps and "
                     "keep the newest keep_checkpoints)")
    backend = run["backend"]
    if backend != "deepspeed" and hdet.get("overlap_gradient_sharing") is False:
        notes.append(f"deepspeed.hdet.overlap_gradient_sharing=false is read by the deepspeed backend only: {backend} "
                     "overlaps its own gradient all-reduce whatever it says")
    if backend in ("ddp", "fairscale") and run["model"].get("sharded_init") is False:
        notes.append(f"model.sharded_init=false has no effect on {backend}, which builds the whole model on every "
                     "rank either way")
    return notes


def probe_note(run: dict, cfg: HDETConfig) -> list[str]:
    """The auto-LR probe (``auto.fitness: probe``) evaluates ``train.probe_batches``
    micro-batches per rank (forward only) at every sync; when that costs more than the
    ``sync_interval x gradient_accumulation_steps`` micro-batches a rank trains between
    syncs (a forward pass is about a third of a forward and backward: more than 3 probe
    micro-batches per trained one), the syncs take most of the run and it looks stalled at
    each one, which nothing else says (e.g. ``train.probe_batches=100000``). Bounded above
    by the training split (a larger value is refused in ``train/loop.py``)."""
    if cfg.replicas <= 1 or not cfg.uses_probe or cfg.sync_interval > run["train"]["steps"]:
        return []
    _, gas = batch_sizes(run["deepspeed"], run["nproc"])
    probe, trained = run["train"]["probe_batches"], cfg.sync_interval * gas
    if probe <= 3 * trained:
        return []
    return [f"train.probe_batches={probe}: every sync (deepspeed.hdet.sync_interval={cfg.sync_interval} steps) the "
            f"auto-LR probe runs {probe} forward micro-batches per rank, more compute than the {trained} micro-batches "
            "each rank trains between syncs (sync_interval x gradient_accumulation_steps, forward and backward): the "
            "syncs will take most of the run's time and each looks like a stall (the default is 2)"]


def repeated_data_note(run: dict) -> list[str]:
    """``data.path`` naming a file or folder again (``a,a``; the same real path), or a path
    inside a folder named before it: the corpus holds each file once, at its first place,
    and such an item changes nothing, the split included (``data_files.collect``), so a
    repeat meant to weight a file does nothing."""
    path = run["data"].get("path")
    if not isinstance(path, str):
        return []
    seen: dict[str, str] = {}
    for part in (p.strip() for p in path.split(",") if p.strip()):
        real = os.path.realpath(os.path.expanduser(part))
        folder = next((seen[d] for d in seen if os.path.isdir(d) and real.startswith(d.rstrip(os.sep) + os.sep)), None)
        if real in seen or folder is not None:
            what = (f"names {part!r} twice{'' if seen.get(real, part) == part else f' (as {seen[real]!r})'}"
                    if real in seen else f"names {part!r} after {folder!r}, which holds it")
            return [f"data.path {what}: the corpus holds each file once, at its first place, and the run is the same "
                    "as without the repeat (to weight a file, give a copy of it)"]
        seen[real] = part
    return []


def unread_notes(run: dict, cfg: HDETConfig) -> list[str]:
    """Values the run reads otherwise than given, or not at all (each is otherwise
    silent): ``optimizer.params.lr`` beside ``hdet.schedule.max_lr`` (the schedule sets
    the LR of every step from max_lr); ``train.eval_batches`` not a multiple of the ranks
    (each rank evaluates ``eval_batches // ranks``, at least 1); ``train.probe_batches``
    without the probe (``auto.fitness`` other than ``probe``, or auto-LR off);
    ``train.resume=true`` where nothing is to resume (a new run from step 0: a run_dir
    mistyped, or relative to another working directory)."""
    from hdet_scale.train.config import TrainConfig
    from hdet_scale.train.rundir import RUN_FILES

    notes, t = [], run["train"]
    lr = ((run["deepspeed"].get("optimizer") or {}).get("params") or {}).get("lr")
    max_lr = cfg.schedule.max_lr if cfg.schedule is not None else None
    if lr is not None and max_lr is not None and any(m != lr for m in (max_lr if isinstance(max_lr, list) else [max_lr])):
        notes.append(f"deepspeed.optimizer.params.lr={lr} has no effect on the LR: deepspeed.hdet.schedule.max_lr="
                     f"{max_lr} sets the peak of the schedule, which sets the LR of every step (change max_lr, or "
                     "leave it out to peak at optimizer.params.lr)")
    world = int(os.environ.get("WORLD_SIZE") or run["nproc"])  # under torchrun: its ranks, not nproc
    per_rank = max(1, t["eval_batches"] // world)
    if per_rank * world != t["eval_batches"]:
        notes.append(f"train.eval_batches={t['eval_batches']}: the validation loss reads {per_rank * world} "
                     f"micro-batches ({per_rank} on each of the {world} ranks: a multiple of the ranks)")
    if t["probe_batches"] != TrainConfig.probe_batches and not cfg.uses_probe:
        why = (f"deepspeed.hdet.auto.fitness={cfg.auto.fitness}" if cfg.auto_can_move else "auto-LR does not run")
        notes.append(f"train.probe_batches={t['probe_batches']} has no effect: {why} (the probe is read only with "
                     "auto.fitness=probe)")
    run_dir = run["run_dir"]
    if t["resume"] and not any(os.path.lexists(os.path.join(run_dir, n)) for n in RUN_FILES):
        notes.append(f"train.resume=true: {os.path.abspath(run_dir)} holds no run to resume (no checkpoint), so this "
                     f"is a new run from step 0 (a relative run_dir is read from the working directory {os.getcwd()})")
    return notes


def eval_overlap_note(run: dict, windows: int, val_bytes: int) -> list[str]:
    """The validation loss reads ``windows`` evenly spaced windows of ``data.seq_len + 1``
    bytes (``data.ByteBatches.eval_batches``); when they hold more bytes than the
    validation split they overlap, and the loss rests on that split's ``val_bytes`` only
    (a 3 kB split may be read 8 times over: said, not silent). Fewer windows
    than the split has are checked in ``loop.validate``."""
    d = run["data"]
    read = windows * (d["seq_len"] + 1)
    if read <= val_bytes:
        return []
    return [f"train.eval_batches={run['train']['eval_batches']}: the validation loss reads {windows} windows of "
            f"data.seq_len+1={d['seq_len'] + 1} bytes from a validation split of {val_bytes} bytes (data.val_fraction="
            f"{d['val_fraction']}): they overlap, each byte is read about {read / val_bytes:.1f} times, and the loss "
            f"rests on those {val_bytes} bytes (a larger data.val_fraction or more data for a steadier one)"]


def split_note(run: dict, train_bytes: int, val_bytes: int) -> list[str]:
    """Data read by neither split (e.g. two files, the larger held out for validation and
    cut at its budget, 100 kB of it unused while training has room: otherwise without a
    word). With several files the split is by file and each split reads its files up to
    its share of ``data.max_bytes`` (``data_read.read_splits``): a full validation split
    beside a training split short of its share means files held out for validation beyond
    that share are read by neither. Otherwise, a validation split holding more than twice
    ``data.val_fraction`` of the bytes read (and 10 points more) gets a note too (e.g.
    76% with 0.1, few files of unequal size)."""
    d = run["data"]
    train_budget = max(1, int(d["max_bytes"] * (1.0 - d["val_fraction"])))
    val_budget = max(1, d["max_bytes"] - train_budget)
    if val_bytes < val_budget or train_bytes >= train_budget:
        share = val_bytes / max(1, train_bytes + val_bytes)
        if share > max(2 * d["val_fraction"], d["val_fraction"] + 0.1):
            # e.g. three files, the largest held out: 76% of the bytes validated with
            # val_fraction 0.1, otherwise without a word
            return [f"data: validation holds {val_bytes} of the {train_bytes + val_bytes} bytes read ({share:.0%}; "
                    f"data.val_fraction={d['val_fraction']}): with several files the split is by file, so a few files "
                    "split unevenly (to train on more, give more or smaller files, or a single file, which is split "
                    "by position)"]
        return []
    return [f"data: the validation split is full at {val_bytes} bytes (data.val_fraction x data.max_bytes) and the "
            f"training split has {train_bytes} of its {train_budget}: the split is by file, so what the files held out "
            "for validation hold beyond that is read by neither split (to train on it, give more or smaller files, "
            "or a single file, which is split by position; to validate on it, raise data.val_fraction)"]


def wandb_env_notes(run: dict, resuming: bool, saved_id: str | None) -> list[str]:
    """What W&B variables of the environment do to this run: ``WANDB_DIR`` is not read
    (the run's W&B files stay in ``wandb.dir``); ``WANDB_RUN_ID`` (two unrelated runs
    may share one W&B id, and a resume ignores it, so both are said): W&B takes
    it as the id of a new run; a resumed run continues the W&B run its checkpoint
    recorded (``saved_id``), whatever the variable says.

    Returns:
        One line per variable that acts otherwise than a user may expect; ``[]`` with
        W&B off, the variables unset or empty, or a resume whose recorded id is the
        ``WANDB_RUN_ID``'s.
    """
    notes = []
    wandb_dir = os.environ.get("WANDB_DIR", "").strip()
    if run["wandb"]["enabled"] and wandb_dir:
        # documented, but nothing else says it at the start
        where = run["wandb"].get("dir") or os.path.join(run["run_dir"], "wandb")
        notes.append(f"WANDB_DIR={wandb_dir!r} is not read: W&B's files go to {where} (wandb.dir, run_dir unless "
                     "set; set wandb.dir to choose)")
    env = os.environ.get("WANDB_RUN_ID", "").strip()
    if not run["wandb"]["enabled"] or not env:
        return notes
    if resuming and saved_id:
        if saved_id == env:
            return notes
        return notes + [f"WANDB_RUN_ID={env!r} is not used: the resumed run continues the W&B run {saved_id!r} its "
                        "checkpoint recorded (a new run_dir starts a new W&B run; unset WANDB_RUN_ID to leave this "
                        "note)"]
    return notes + [f"WANDB_RUN_ID={env!r}: W&B takes this id for the run, and a later run started with the same "
                    "variable logs into the same W&B run (unset it to give each run its own id); a resume of this run "
                    "continues it"]
