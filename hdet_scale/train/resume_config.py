"""What a resumed ``hdet-train`` run may change from the run that wrote its checkpoint.

Every save records the run's settings (:func:`record`: the resolved run config as
``{dotted key: value}``, the ``hdet`` block with its defaults filled in) for its tag, in
``checkpoint/hdet_run_config.json`` (:data:`RECORD_FILE`; rank 0 writes it atomically
just before the save, and keeps only the tags the checkpoint index still lists). A resume
compares the record of the tag ``latest`` names with its own settings before any rank
starts (:func:`check`), so nothing of the stopped run is touched by a refusal:

- A change that cannot work is an error listing every such key ``old -> new``: the
  model's shape (the saved weights and optimizer state would not fit), the optimizer
  type (the saved state is another optimizer's), and the HDET settings its saved state
  is tied to (``sync_interval``, ``auto.controller``, ``auto.groups``, the explored axes,
  their groups and kind: ``HDETScheduler.load_state_dict`` refuses them after the engine
  start) and the schedule's length (``schedule.total_steps``). The layout (world size,
  replicas, shard size) and the backend are checked from ``hdet_layout.json``
  (``backends.checkpoints.check_resumable``).
- Any other change is allowed (a lower LR on resume is common practice) and announced in
  one warning listing every changed key ``old -> new`` and the value the resumed run
  actually uses (:func:`notice`). That is not always the new one: the optimizer's
  parameter groups (betas, eps, a weight decay HDET does not explore) are restored with
  its state, the permutation generator continues from its saved state, and the
  ``"paper"`` controller's base LR, once meta-updated, continues from the saved value.
  tests/distributed/test_resume.py holds these statements to a real load.
- The bytes trained on: each record holds the corpus' ``data.fingerprint`` (sizes and
  CRC-32 of the splits); a resume whose bytes differ with the data keys unchanged (files
  added to ``data.path``, lines appended) is told so in the same warning
  (:func:`data_change`). ``data.path`` is compared as the files it resolves to.
- ``wandb.project`` and ``wandb.entity`` changed while the checkpoint recorded a W&B run
  are told too: W&B then opens a new run of the recorded id in the new place.
- Keys that only say where and how a run is kept (``run_dir``, the other ``wandb.*``,
  ``hdet.logging``, the checkpoint cadence, ``train.steps``, ``nproc``) are not compared.

A record that lists no entry for the tag (``{"runs": {}}``, written by hand to resume
on purpose without the comparison) resumes without it; a missing or damaged record file
is refused, naming that way out.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError
from hdet_scale.backends.checkpoint_io import LAYOUT_FILE, checkpoint_index, read_latest, write_atomic
from hdet_scale.backends.checkpoints import read_layout
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETStateError
from hdet_scale.resume_changes import flatten
from hdet_scale.train.model_config import VOCAB_SIZE

RECORD_FILE = "hdet_run_config.json"
WANDB_RUN_ID = "wandb.run_id"  # in a tag's record: the W&B run its resume continues
DATA_FINGERPRINT = "data.fingerprint"  # in a tag's record: the bytes trained on (data.fingerprint)
# what else makes the bytes read differ: their own lines say so, the data line would repeat it
_READS_DATA = ("data.path", "data.max_bytes", "data.val_fraction", "seed")
_EMPTY_RECORD = '{"runs": {}}'
RECORD_VERSION = 1
_UNSET = object()  # a key one side does not have

_NOT_COMPARED = {DATA_FINGERPRINT, "run_dir", "nproc", "deepspeed_config", "backend", "train.steps",
                 "train.checkpoint", "train.checkpoint_every", "train.keep_checkpoints", "train.resume",
                 "train.overwrite", "train.progress", "train.plots", "model.activation_checkpointing",
                 "model.sharded_init", "deepspeed.hdet.enabled", "deepspeed.hdet.replicas", "deepspeed.hdet.bucket_mb",
                 "deepspeed.steps_per_print", "deepspeed.wall_clock_breakdown"}
_NOT_COMPARED_PREFIXES = ("wandb.", "deepspeed.hdet.logging.")
_WANDB_PLACE = ("wandb.project", "wandb.entity")  # where the recorded W&B run is: told when changed
_SHAPE = "the model's architecture: the saved weights and optimizer state are shaped for the checkpoint's"
_HDET_STATE = "the saved HDET state is tied to it; HDETScheduler.load_state_dict refuses the change"
_ERRORS = {
    **{f"model.{k}": _SHAPE for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                                      "tie_embeddings", "vocab_size")},
    "deepspeed.optimizer.type": "the saved optimizer state belongs to the checkpoint's optimizer",
    "deepspeed.hdet.sync_interval": _HDET_STATE,
    "deepspeed.hdet.auto.controller": _HDET_STATE,
    "deepspeed.hdet.auto.groups": _HDET_STATE,
    # "train.steps sets it unless ... total_steps is given" reads as a way to lengthen the
    # run, and giving it fails ("shorter than train.steps"); "at most the checkpoint's
    # value" is refused too (a smaller train.steps shortens the schedule)
    "deepspeed.hdet.schedule.total_steps": "the schedule's length (train.steps sets it unless "
                                           "deepspeed.hdet.schedule.total_steps is given), which a resumed run "
                                           "keeps: resume with the same train.steps, or to stop earlier add "
                                           "deepspeed.hdet.schedule.total_steps=<the checkpoint's value> with a "
                                           "smaller train.steps; to train "
                                           "longer, start a new run_dir with schedule.total_steps set to the whole "
                                           "length (a run can stop before its end and be resumed up to it)",
    **{f"deepspeed.{k}.enabled": "the precision the saved weights and optimizer state were written in (DeepSpeed "
                                 "names its optimizer files by it); converge first and start a new run to change it"
       for k in ("bf16", "fp16")},
    "deepspeed.zero_optimization.stage": "the ZeRO stage the saved partitions were written by",
}
# A key whose absence means this value (DeepSpeed's default): unset -> default is no change.
_DEFAULTS = {"deepspeed.bf16.enabled": False, "deepspeed.fp16.enabled": False}


def record(run: dict) -> dict[str, Any]:
    """The run's settings as ``{dotted key: JSON value}`` (``run``: a resolved run config,
    ``train.config.load_run_config``): the ``hdet`` block parsed with its defaults, and
    ``model.vocab_size`` (fixed by the byte vocabulary, recorded should it ever change)."""
    hdet = HDETConfig.from_dict(run["deepspeed"].get("hdet") or {}).to_dict()
    tree = {**run, "model": {**run["model"], "vocab_size": VOCAB_SIZE}, "deepspeed": {**run["deepspeed"], "hdet": hdet}}
    return json.loads(json.dumps(flatten(tree), default=str))  # the values as they read back


def _read(path: str) -> dict:
    """The record file at ``path`` (``{}`` when there is none).

    Raises:
        HDETStateError: it is not the JSON this module writes (the message names it).
    """
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json_load(f)
        if not isinstance(data, dict) or not isinstance(data.get("runs", {}), dict):
            raise ValueError("not a JSON object with a 'runs' object")
    except (OSError, ValueError) as e:
        raise HDETStateError(f"train.resume: {path} is damaged ({e}); it records the settings each checkpoint was "
                             f"saved with: restore it from a copy, or write {_EMPTY_RECORD} into it to resume "
                             "without comparing them") from None
    return data


def save_record(save_dir: str, tag: str, run: dict, wandb_run_id: str | None = None,
                data: dict | None = None) -> None:
    """Rank 0, just before the save of ``tag`` into ``save_dir``: record ``run``'s
    settings for ``tag`` (and ``wandb_run_id``, the W&B run the tag's resume continues;
    ``data``, the corpus' ``data.fingerprint``, which a resume compares with its own),
    keeping those of the tags the checkpoint index still lists.
    Atomic (``checkpoint_io.write_atomic``). A damaged record file is replaced: the older
    tags then resume unchecked, as before the record existed."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, RECORD_FILE)
    try:
        runs = _read(path).get("runs", {})
        with open(os.path.join(save_dir, LAYOUT_FILE)) as f:
            index = checkpoint_index(json_load(f), read_latest(save_dir))
    except (HDETStateError, OSError, ValueError, TypeError, AttributeError):
        runs, index = {}, {}
    runs = {t: r for t, r in runs.items() if t in index and t != tag}
    runs[tag] = record(run)
    if wandb_run_id is not None:
        runs[tag][WANDB_RUN_ID] = wandb_run_id  # "wandb." keys are never compared
    if data is not None:
        runs[tag][DATA_FINGERPRINT] = data
    write_atomic(path, json.dumps({"version": RECORD_VERSION, "runs": runs}))


def _fmt(value: Any) -> str:
    return "(unset)" if value is _UNSET else json.dumps(value)


def _first_meta_step(rec: dict) -> int:
    """The step of the first auto-LR meta-update of the run recorded in ``rec``
    (``HDETConfig.first_meta_step``)."""
    interval = rec.get("deepspeed.hdet.sync_interval") or 1
    return max(math.ceil((rec.get("deepspeed.hdet.auto.warmup_steps") or 0) / interval), 1) * interval


def _axis_keys(rec: dict) -> set[str]:
    return {k.split(".")[3] for k in rec if k.startswith("deepspeed.hdet.axes.")}


def _fold_lone_axes(rec: dict, other: dict) -> dict:
    """``rec`` with each axis that ``other`` does not explore as one key
    (``deepspeed.hdet.axes.weight_decay: {...}``): an added or removed axis is one line."""
    lone = _axis_keys(rec) - _axis_keys(other)
    if not lone:
        return rec
    out = {}
    for k, v in rec.items():
        parts = k.split(".")
        if k.startswith("deepspeed.hdet.axes.") and parts[3] in lone:
            out.setdefault(".".join(parts[:4]), {})[".".join(parts[4:])] = v
        else:
            out[k] = v
    return out


def _error_reason(key: str, saved: dict, now: dict) -> str | None:
    backend = now.get("backend", "deepspeed")
    if key == "deepspeed.zero_optimization.stage" and backend != "deepspeed":
        return None  # the other engines never read it (their note says so)
    if key in ("deepspeed.bf16.enabled", "deepspeed.fp16.enabled") and backend != "deepspeed":
        return ("the precision the saved weights and optimizer state were written in; converge first and start "
                "a new run to change it")
    if key in _ERRORS:
        return _ERRORS[key]
    if key.startswith("deepspeed.hdet.axes."):
        axis = key.split(".")[3]
        if axis not in _axis_keys(saved) or axis not in _axis_keys(now):
            return "the explored axes, to which the saved HDET state is tied"
        if key.endswith((".groups", ".kind")):
            return _HDET_STATE
    return None


def _uses(key: str, new: Any, saved: dict, now: dict, step: int) -> str:
    """Which value of the changed ``key`` the resumed run uses, and why."""
    uses = f"the resumed run uses {'its default' if new is _UNSET else _fmt(new)}"
    kept = f"the resumed run keeps the checkpoint's value {_fmt(saved.get(key, _UNSET))}"
    auto_lr = (saved.get("deepspeed.hdet.auto.enabled") and step >= _first_meta_step(saved)
               and saved.get("deepspeed.hdet.axes.lr.auto") is not False)
    if key == "deepspeed.optimizer.params.lr" and now.get("deepspeed.hdet.schedule.max_lr") is not None:
        return "no effect on the LR: deepspeed.hdet.schedule.max_lr sets the peak"
    if key in ("deepspeed.optimizer.params.lr", "deepspeed.hdet.schedule.max_lr"):
        if auto_lr and saved.get("deepspeed.hdet.auto.controller") == "paper":
            return ("the resumed run keeps the checkpoint's base LR: the 'paper' controller continues from its saved, "
                    "meta-updated base; the new peak only moves its floor")
        learned = ", times the auto-LR multiplier restored from the checkpoint" if auto_lr else ""
        return f"{uses}: the schedule's peak LR{learned}"
    if key.startswith("deepspeed.optimizer.params."):
        name = key.split(".")[3]
        if name in _axis_keys(now):
            return f"{uses}: HDET sets it every step (deepspeed.hdet.axes.{name})"
        if name == "betas" and "beta2" in _axis_keys(now) and isinstance(new, list) and len(new) == 2:
            # not "keeps the checkpoint's value" while the new beta2 is used
            old = saved.get(key)
            beta1 = ("" if isinstance(old, list) and old[:1] == new[:1] else
                     "; beta1 keeps the checkpoint's (the optimizer's parameter groups are restored with its state)")
            return (f"the resumed run uses beta2 {_fmt(new[1])}: HDET sets it every step "
                    f"(deepspeed.hdet.axes.beta2){beta1}")
        if name == "betas" and now.get("deepspeed.hdet.schedule.cycle_momentum"):
            return (f"{kept} for beta2; beta1 follows the momentum cycle of deepspeed.hdet.schedule: the optimizer's "
                    "parameter groups are restored with its state")
        return f"{kept}: the optimizer's parameter groups are restored with its state"
    if key == "deepspeed.hdet.seed":
        return f"{kept}: the replica permutations continue from the generator state saved in the checkpoint"
    if key.startswith("deepspeed.hdet.warm_init."):
        return "no effect on a resumed run: warm initialisation runs only at step 0"
    if key == "model.init_seed":  # announced, not silent: the weights come from the checkpoint
        return "no effect on a resumed run: it seeds the initial weights, which the checkpoint replaces"
    if key == "train.eval_batches":
        return (f"{uses}: the validation loss from here on is measured on {_fmt(new)} batches, the earlier "
                f"records' on {_fmt(saved.get(key, _UNSET))}: compare them with care")
    if key == "deepspeed.hdet.auto.enabled":
        return f"{uses}; what auto-LR learned up to the checkpoint (restored from it) stays in effect"
    if key == "seed":
        return (f"{uses}: it draws the training and probe batches and splits the data into training and "
                "validation anew, so the resumed run trains on bytes held out before and its validation loss is "
                "measured on other bytes (dropout continues from the RNG state saved)")
    if key == "deepspeed.zero_optimization.stage":
        return f"no effect: the {now.get('backend')} backend does not read it"
    if key.startswith("deepspeed.hdet.axes.") and key.endswith(".auto") and new is False and \
            saved.get("deepspeed.hdet.auto.enabled") and step >= _first_meta_step(saved):
        # "uses false" would hide that the learned multiplier stays, frozen
        return f"{uses}: what auto-LR learned for it up to the checkpoint (restored from it) stays, no longer moved"
    axis = _model_axis(key, now)
    if axis and saved.get("deepspeed.hdet.auto.enabled") and step >= _first_meta_step(saved) \
            and saved.get(f"deepspeed.hdet.axes.{axis}.auto"):  # "uses 0.2" would hide the learned shift
        if saved.get("deepspeed.hdet.auto.controller") == "paper":
            return (f"the resumed run keeps the {axis} axis' meta-updated base saved in the checkpoint (the 'paper' "
                    "controller continues from it); the new value is not used")
        return f"{uses} as the {axis} axis' base, moved by what auto-LR learned up to the checkpoint (restored from it)"
    return uses


def _model_axis(key: str, now: dict) -> str | None:
    """The model-side axis whose base ``key`` is: ``deepspeed.hdet.axes.<axis>.value``, or
    ``model.dropout`` in a run with a dropout axis (hdet-train fills the value from it)."""
    parts = key.split(".")
    if len(parts) == 5 and key.startswith("deepspeed.hdet.axes.") and parts[4] == "value":
        return parts[3]
    return "dropout" if key == "model.dropout" and "dropout" in _axis_keys(now) else None


def compare(saved: dict, now: dict, step: int) -> tuple[list[str], list[str]]:
    """``(errors, changes)``: one line per changed key, ``"key: old -> new ..."``, for
    the record ``saved`` of a checkpoint at optimizer step ``step`` and this run's
    record ``now`` (both :func:`record`). Errors say what the key determines; changes say
    which value the resumed run uses. Pure."""
    errors, changes = [], []
    saved, now = _fold_lone_axes(saved, now), _fold_lone_axes(now, saved)
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key, _UNSET), now.get(key, _UNSET)
        if key in _WANDB_PLACE and old != new and saved.get(WANDB_RUN_ID) and now.get("wandb.enabled"):
            # a resume told "continues the W&B run X" would log into another project
            changes.append(f"{key}: {_fmt(old)} -> {_fmt(new)}: the resumed run opens its W&B run "
                           f"{saved[WANDB_RUN_ID]!r} in the new {key.split('.')[1]}; W&B knows a run by its project "
                           f"and id, so that is a new W&B run there, and the records up to step {step} stay in the "
                           f"checkpoint's (keep {key}={_fmt(old)} to continue its curves)")
            continue
        if key in _NOT_COMPARED or key.startswith(_NOT_COMPARED_PREFIXES):
            continue
        if key in _DEFAULTS and {old, new} <= {_UNSET, _DEFAULTS[key]}:
            continue
        if old == new or (key == "deepspeed.optimizer.type" and str(old).lower() == str(new).lower()):
            continue  # DeepSpeed reads optimizer names case-insensitively
        if key == "data.path" and _same_paths(old, new):
            continue  # data1/ and its absolute path are one folder
        if key == "deepspeed.hdet.axes.dropout.value" and (saved.get("model.dropout"), now.get("model.dropout")) \
                == (old, new):
            continue  # hdet-train fills it from model.dropout: that key's line says it
        line = f"{key}: {_fmt(old)} -> {_fmt(new)}"
        reason = _error_reason(key, saved, now)
        if reason is not None:
            errors.append(f"{line}: {reason}")
        else:
            changes.append(f"{line}: {_uses(key, new, saved, now, step)}")
    return errors, changes


def _same_paths(old: Any, new: Any) -> bool:
    """``data.path`` values naming the same files: each ``,``-separated part resolved
    (``os.path.realpath``, relative to this process' folder, as the run reads them)."""
    if not isinstance(old, str) or not isinstance(new, str):
        return False
    parts = [[os.path.realpath(p.strip()) for p in v.split(",") if p.strip()] for v in (old, new)]
    return parts[0] == parts[1]


def data_change(saved: dict, now: dict, data: dict | None) -> str | None:
    """The line for a resume whose training bytes differ from those the checkpoint's run
    recorded (``saved[DATA_FINGERPRINT]``; ``now``: this run's :func:`record`; ``data``:
    its ``data.fingerprint``), or ``None``: the same bytes, no record of them (a checkpoint
    saved before they were recorded), or a changed ``data.path`` / ``data.max_bytes`` /
    ``data.val_fraction`` / ``seed``, whose own line says it (files added to the data
    folder, or lines appended, would be trained on without a word)."""
    old = saved.get(DATA_FINGERPRINT)
    if not isinstance(old, dict) or not isinstance(data, dict) or old == data:
        return None
    for key in _READS_DATA:
        was, is_ = saved.get(key, _UNSET), now.get(key, _UNSET)
        if was != is_ and not (key == "data.path" and _same_paths(was, is_)):
            return None
    sizes = [f"{what} split {old.get(k)} -> {data.get(k)} bytes" for what, k in
             (("training", "train_bytes"), ("validation", "val_bytes")) if old.get(k) != data.get(k)]
    how = ", ".join(sizes) if sizes else "the same sizes, other content"
    return (f"data: the bytes data.path reads changed since the checkpoint was saved ({how}): the resumed run "
            "trains on the new bytes (its batches drawn from them anew) and measures its validation loss on the "
            "new split: compare it with the earlier records with care")


def _saved_record(save_dir: str) -> tuple[dict | None, str | None, int]:
    tag = read_latest(save_dir)
    step = read_layout(save_dir)["step"]
    path = os.path.join(save_dir, RECORD_FILE)
    if not os.path.exists(path) and not os.path.islink(path):
        # every hdet-train save writes it: without it a changed model shape would reach
        # the ranks' load and fail there, after the start
        raise HDETStateError(f"train.resume: {path} is missing; every hdet-train save writes it (the settings each "
                             "checkpoint was saved with, compared before a resume). Restore it from a copy, or "
                             f"write {_EMPTY_RECORD} into it to resume without the comparison (then every setting "
                             "that shapes the model and optimizer must be the checkpoint's), or start a new run_dir")
    runs = _read(path).get("runs", {})
    saved = runs.get(tag)
    return (saved if isinstance(saved, dict) else None), tag, step


def saved_wandb_run_id(save_dir: str) -> str | None:
    """The W&B run id recorded with the tag ``latest`` names, or ``None``. Never
    raises (a missing or damaged record is refused by :func:`check` before this)."""
    try:
        saved, _, _ = _saved_record(save_dir)
    except (HDETStateError, OSError, ValueError, KeyError, TypeError):
        return None
    value = (saved or {}).get(WANDB_RUN_ID)
    return value if isinstance(value, str) and value else None


def check(run: dict, save_dir: str) -> list[str]:
    """Compare the resumed run ``run`` with the record of the checkpoint ``latest`` names
    in ``save_dir`` (after ``checkpoints.check_resumable`` passed). Returns the allowed
    changes (:func:`compare`; empty without a record). Reads files only.

    Raises:
        HDETStateError: a change that cannot work, listing every such key with its
            checkpoint value -> new value; or a damaged record file.
    """
    return _checked(run, save_dir, *_saved_record(save_dir))


def _checked(run: dict, save_dir: str, saved: dict | None, tag: str | None, step: int) -> list[str]:
    """:func:`check` on the record ``saved`` already read (``_saved_record``)."""
    if saved is None:
        return []
    errors, changes = compare(saved, record(run), step)
    if errors:
        raise HDETStateError(f"train.resume: the checkpoint {save_dir} ({tag}, step {step}) cannot continue with "
                             "these settings changed since it was saved (checkpoint -> this run):\n  "
                             + "\n  ".join(errors) + "\nResume with the checkpoint's values, or start the changed "
                             "run in another run_dir")
    return changes


def notice(run: dict, save_dir: str, data: dict | None = None) -> str | None:
    """The one warning for a resume from ``save_dir`` whose settings changed (every
    changed key, ``old -> new``, and the value the resumed run uses) or whose training
    bytes differ from the checkpoint's (``data``: this run's ``data.fingerprint``;
    :func:`data_change`), or ``None``.

    Raises:
        HDETStateError: as :func:`check`.
    """
    saved, tag, step = _saved_record(save_dir)  # read once for both
    changes = _checked(run, save_dir, saved, tag, step)
    line = data_change(saved or {}, record(run), data)
    changes += [line] if line else []
    if not changes:
        return None
    return (f"train.resume: continuing {save_dir} ({tag}, step {step}) with settings changed since that checkpoint "
            "was saved (checkpoint -> this run):\n  " + "\n  ".join(changes))
