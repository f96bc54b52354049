"""The checks ``hdet-train`` runs on a run config before any collective, identically on
every rank and in its own launcher (:func:`validate`): the DeepSpeed JSON's keys and
values, the ``hdet`` block, the engine's optimizer, the model, the data splits against
the batch sizes, the run_dir (writable, resumable), W&B's settings. Split out of
``loop.py``, which re-exports :func:`validate`.
"""

from __future__ import annotations

import re
import warnings

from hdet_scale.backends.common import resolve_config
from hdet_scale.backends.checkpoints import check_resumable, read_layout
from hdet_scale.backends.deepspeed import prepare_config
from hdet_scale.backends.ds_machine import check_accelerator
from hdet_scale.config import HDETConfig, WandbConfig
from hdet_scale.ds_keys import check_deepspeed_keys
from hdet_scale.ds_values import batch_sizes
from hdet_scale.errors import HDETConfigError, HDETStateError, HDETUntrustedFileError
from hdet_scale.logging import check_wandb_settings
from hdet_scale.param_groups import check_group_count
from hdet_scale.train import fault_hook, run_checkpoint, rundir
from hdet_scale.train.data import ByteBatches, load_corpus
from hdet_scale.train.data_place import check_apart, holding_part
from hdet_scale.train.run_dir_place import refuse_root
from hdet_scale.autolr import build_schedule, check_additive_floors
from hdet_scale import iterates
from hdet_scale.engine_config import (OPTIMIZERS, check_optimizer_axes, client_built, optimizer_axis_errors,
                                      optimizer_class_name, optimizer_errors)
from hdet_scale.train.engines import axis_bases, check_engine_config
from hdet_scale.train.model import ModelConfig, check_buildable
from hdet_scale.train.run_notes import eval_overlap_note, split_note


#: The optimizer's parameter groups in every hdet-train engine: ``engines.Engine`` hands it
#: ``model.parameters()``, one group (so ``hdet.schedule.max_lr`` lists one value, and
#: ``hdet.axes.<axis>.groups`` can name group 0 only).
PARAM_GROUPS = 1


def _in_trainer_terms(e: HDETConfigError) -> HDETConfigError:
    # The hdet block and DeepSpeed keys live under "deepspeed." in the trainer config.
    text = re.sub(r"(?<![\w.])(hdet\.|scheduler:|zero_optimization\.|fp16\.|train_batch_size:|optimizer\.type:|optimizer\.params\.|gradient_predivide_factor:)",
                  r"deepspeed.\1", str(e))
    # hdet-train fills the dropout axis' value from model.dropout (train/config.py), which
    # is the key to change (not the axis' value)
    # (a value of the wrong type is the user's own axis value: named as it is)
    text = re.sub(r"deepspeed\.hdet\.axes\.dropout\.value: (?=\S+ with spread_ratio)",
                  "model.dropout (the base of deepspeed.hdet.axes.dropout in hdet-train): ", text)
    return HDETConfigError(text)


#: The library's refusal of a world that ``hdet.replicas`` does not divide (topology.Layout),
#: with its hint for a world of 1 (a plain ``python`` start), as ``_in_trainer_terms`` words it.
_NOT_DIVIDING = re.compile(r"deepspeed\.hdet\.replicas: (\d+) replicas do not divide the world of (\d+) ranks; "
                           r"allowed values for this world: (\[[\d, ]*\]|the divisors of \d+)"
                           r"(?: \(a world of 1: [^()]*\?\))?")


def in_nproc_terms(e: HDETConfigError, nproc: int, given: bool) -> HDETConfigError:
    """``e`` with the world-size refusal reworded for ``hdet-train``'s own launcher, whose
    world is ``nproc`` (``given``: set by the user, else the default), so that ``nproc=1``
    is not asked whether a script was started with plain ``python``. ``e``
    itself when it holds no such refusal (other lines of a collected error are kept)."""
    def words(m: re.Match) -> str:
        replicas, divisors = int(m.group(1)), m.group(3)
        source = f"nproc={nproc}" if given else f"nproc={nproc} (the default)"
        return (f"deepspeed.hdet.replicas: {source} gives a world of {nproc} rank{'s' if nproc != 1 else ''}, and "
                f"deepspeed.hdet.replicas={replicas} needs nproc to be a multiple of {replicas} (nproc={replicas}, "
                f"{2 * replicas}, ...); or set deepspeed.hdet.replicas to one of {divisors}")

    text, n = _NOT_DIVIDING.subn(words, str(e))
    return type(e)(text) if n else e


def _require_deepspeed() -> None:
    """Refuse ``backend=deepspeed`` where DeepSpeed cannot be imported (the ``[fsdp]``
    extra leaves it out): one line naming the extra, not a traceback from every rank.

    Raises:
        HDETConfigError: naming the import error and ``pip install "hdet-scale[deepspeed]"``.
    """
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise HDETConfigError(f"backend=deepspeed: DeepSpeed cannot be imported here ({e}): "
                              'pip install "hdet-scale[deepspeed]", or choose backend=fsdp2, ddp or fairscale') from None


def validate(run: dict, world_size: int, build_model: bool = True):
    """All checks that can fail on bad input, before any collective; identical on every
    rank. Returns ``(hdet_config, corpus)``. Raises HDETConfigError / HDETStateError.
    ``build_model``: also build the model on the meta device (``model.check_buildable``:
    what transformers refuses). It imports transformers' model code (2.5 s here), which
    the ranks import anyway, so ``hdet-train``'s own launcher leaves it to its ranks;
    they run it before rank 0 prepares the run_dir (``train.overwrite``) or W&B starts."""
    backend = run["backend"]
    if backend == "deepspeed":
        _require_deepspeed()
    # Every backend's settings come from this DeepSpeed JSON: an unknown key (an "hdett"
    # block, a typo) is an error here, not the library's warning (hdet_scale.ds_keys).
    check_deepspeed_keys(run["deepspeed"], strict=True, prefix="deepspeed.", optimizer_params=backend == "deepspeed")
    try:
        if backend == "deepspeed":
            try:  # this machine's limits, said with the config's errors (Lamb: both at once)
                check_accelerator(run["deepspeed"])
                machine = ""
            except HDETConfigError as e:
                machine = str(e)
            try:
                hcfg, _ = prepare_config(run["deepspeed"], world_size=world_size)
            except HDETConfigError as e:
                raise HDETConfigError("\n  ".join([str(e), *(line.strip() for line in machine.splitlines()[1:])])
                                      ) if machine else e from None
            if machine:
                raise HDETConfigError(machine)
        else:
            hcfg = HDETConfig.from_dict(run["deepspeed"].get("hdet") or {})
            if hcfg.enabled:
                hcfg = resolve_config(hcfg, world_size)
        if hcfg.enabled:  # the library's words, before anything starts (it finds them in every rank, after W&B)
            check_group_count(hcfg, PARAM_GROUPS)
    except HDETConfigError as e:
        # the optimizer-side axes' checks below, said with this error rather than once it
        # is fixed
        extra = [line for line in optimizer_axis_errors(run["deepspeed"].get("hdet"), run["deepspeed"], backend,
                                                        prefix="deepspeed.hdet") if line not in str(e)]
        if extra:
            lines = str(e).splitlines()
            head = lines if len(lines) > 1 and lines[0].endswith(":") else ["invalid config:", *lines]
            e = HDETConfigError("\n  ".join([head[0], *[line.strip() for line in head[1:]], *extra]))
        raise _in_trainer_terms(e) from None
    if backend != "deepspeed":
        check_engine_config(run["deepspeed"], backend, world_size)
    elif client_built(run["deepspeed"]):  # built by hdet_scale, not DeepSpeed: its arguments checked here
        errors = optimizer_errors(run["deepspeed"], backend)
        if errors:
            raise HDETConfigError("invalid run config:\n  " + "\n  ".join(errors))
    kind = optimizer_class_name(((run["deepspeed"].get("optimizer") or {}).get("type")))
    if hcfg.enabled and kind in OPTIMIZERS:
        msg = iterates.schedule_warning(OPTIMIZERS[kind], hcfg.schedule.name)
        if msg:
            warnings.warn(f"hdet_scale: deepspeed.{msg}", UserWarning, stacklevel=1)  # printed once
    elif not run["deepspeed"].get("optimizer"):  # the trainer builds it from the block
        raise HDETConfigError("deepspeed.optimizer: hdet-train builds the optimizer from this block, and "
                              f"{run['deepspeed_config'] or 'the DeepSpeed JSON'} has none; add one, e.g. "
                              "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-3}}")
    # dropout / temperature must find modules to set in the model hdet-train builds: on
    # the meta model here, not after every rank started (29 s on DDP)
    model_side = hcfg.enabled and any(a in hcfg.axes for a in ("dropout", "temperature"))
    if build_model or model_side:  # what transformers refuses, before train.overwrite removes anything
        meta = check_buildable(ModelConfig(**run["model"]))
        if model_side:
            from hdet_scale.model_axes import setters

            try:
                setters(meta, hcfg)
            except HDETConfigError as e:
                raise HDETConfigError(f"deepspeed.{e}") from None
    if hcfg.enabled:  # beta2 / eps on SGD; an additive spread taking a value below 0; bounds
        check_optimizer_axes(hcfg, run["deepspeed"])
        check_additive_floors(hcfg, build_schedule(hcfg), axis_bases(hcfg, run["deepspeed"], backend),
                              prefix="deepspeed.hdet")
    if not hcfg.enabled:
        raise HDETConfigError("deepspeed.hdet.enabled: hdet-train trains with HDET; for plain data parallelism "
                              "keep it true and set deepspeed.hdet.axes.lr.spread_ratio=0 "
                              "deepspeed.hdet.auto.enabled=false (identical to plain data parallelism with gradient_sharing "
                              "'global')")
    d = run["data"]
    refuse_root(run["run_dir"])  # first: every other run_dir check would read "/" as a folder like any other
    check_apart(d["path"], run["run_dir"])
    wdir = run["wandb"].get("dir")
    if run["wandb"]["enabled"] and isinstance(wdir, str) and wdir and d["path"] is not None:
        # W&B's logs inside data.path would be training data at the resume
        if (part := holding_part(str(d["path"]), wdir)) is not None:
            raise HDETConfigError(f"wandb.dir: {wdir!r} is inside data.path {part!r}: W&B's logs would be read "
                                  "as training data (at a resume); put wandb.dir outside data.path")
    corpus = load_corpus(d["path"], d["val_fraction"], d["max_bytes"], run["seed"], run["run_dir"])
    # the keys the config leaves out derived as DeepSpeed does (a bad one: named by the checks)
    micro, gas = batch_sizes(run["deepspeed"], world_size)
    train_windows = ByteBatches(corpus.train, d["seq_len"], micro * gas, run["seed"], 0, world_size,
                                key="data (training split)").num_windows
    # micro-batches of 1 on one rank: the split must hold one window; the size each rank
    # reads is checked below, naming the key that asks for it
    val = ByteBatches(corpus.val, d["seq_len"], 1, run["seed"], 0, 1, key="data (validation split, data.val_fraction)")
    if hcfg.uses_probe and isinstance(micro, int):
        # the probe's fixed windows are built at once on every rank, like eval_batches
        # (probe_batches=100000 would allocate gigabytes, then a traceback)
        shards = world_size // hcfg.replicas
        probe = run["train"]["probe_batches"] * shards * micro
        if probe > train_windows:
            raise HDETConfigError(
                f"train.probe_batches={run['train']['probe_batches']} asks for {probe} windows (x "
                f"train_micro_batch_size_per_gpu={micro} x {shards} shard ranks) of data.seq_len={d['seq_len']} "
                f"bytes, and the training split has {train_windows}: at most "
                f"{max(1, train_windows // (micro * shards))}")
    # evaluation reads evenly spaced windows of the split, built at once on every rank:
    # more than the split has would read each several times and (100000 batches)
    # allocate gigabytes before failing with a traceback
    asked = max(1, run["train"]["eval_batches"] // world_size) * world_size * micro
    if isinstance(micro, int) and asked > val.num_windows:
        most = max(1, val.num_windows // (micro * world_size)) * world_size
        raise HDETConfigError(f"train.eval_batches={run['train']['eval_batches']} asks for {asked} windows "
                              f"(x train_micro_batch_size_per_gpu={micro}) of data.seq_len={d['seq_len']} bytes, and "
                              f"the validation split ({len(corpus.val)} bytes, data.val_fraction="
                              f"{d['val_fraction']}) has {val.num_windows}: at most {most}, or a larger "
                              "data.val_fraction")
    for note in split_note(run, len(corpus.train), len(corpus.val)):
        warnings.warn(f"hdet_scale: {note}", UserWarning, stacklevel=1)  # printed once: cli._validate_once
    for note in eval_overlap_note(run, asked, len(corpus.val)) if isinstance(micro, int) else []:
        warnings.warn(f"hdet_scale: {note}", UserWarning, stacklevel=1)  # printed once: cli._validate_once
    fault_hook.fault_point(world_size, run["train"]["steps"])  # a bad test hook fails here, on every rank alike
    rundir.check_writable(run["run_dir"])  # before any rank starts, not four tracebacks later
    if run["wandb"]["enabled"]:
        check_wandb_settings(WandbConfig(**run["wandb"]))
        if run["wandb"]["dir"]:  # W&B would silently write elsewhere
            rundir.check_writable(run["wandb"]["dir"], key="wandb.dir")
    ckpt = rundir.checkpoint_dir(run)
    # Never replace a run the user already has: resume it, or refuse naming train.overwrite.
    resuming = rundir.start_mode(run) == "resume"
    if resuming:
        try:
            check_resumable(ckpt, world_size, hcfg.replicas, backend)
        except HDETUntrustedFileError:
            raise  # names the file; no setting resumes it
        except HDETStateError as e:
            # a layout or backend mismatch: the settings that resume it (this run's own
            # values, listed right after "resume with the same", would read as the fix)
            this = ""
            if "written by" in str(e):
                saved = read_layout(ckpt)
                this = (f" (to resume it: backend={saved.get('backend', 'deepspeed')}, a world of "
                        f"{saved['replicas'] * saved['shard_size']} ranks from nproc or the launcher, "
                        f"deepspeed.hdet.replicas={saved['replicas']}; or use another run_dir)")
            raise HDETStateError(f"train.resume: {e}{this}") from None
        rundir.check_resume_config(run)  # a changed model shape...: refused here, naming every key
        run_checkpoint.check_resume_writable(run["run_dir"], ckpt)
        saved = read_layout(ckpt)
        if saved.get("total_steps") not in (None, hcfg.schedule.total_steps):
            raise HDETStateError(f"train.resume: the checkpoint's schedule has total_steps={saved['total_steps']}, "
                                 f"this run {hcfg.schedule.total_steps} (train.steps); resume with the same "
                                 "train.steps, or start a new run_dir")
        if saved.get("step", 0) >= run["train"]["steps"]:
            raise HDETStateError(f"train.resume: the checkpoint is at step {saved['step']}, nothing is left to do "
                                 f"for train.steps={run['train']['steps']}")
    return hcfg, corpus
