"""The ``hdet`` block as :class:`hdet_scale.hf.HDETTrainer` checks it: ``"auto"`` values
the ``Trainer`` fills (the run length, and its own DeepSpeed autos) and an explicit run
length held to the ``Trainer``'s optimizer steps. Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from hdet_scale.config_checks import MAX_STEPS
from hdet_scale.errors import HDETConfigError


def _without_auto(value: Any) -> Any:
    """A copy of a DeepSpeed config without the ``"auto"`` values ``Trainer`` fills only
    when training starts (bucket sizes from the model's hidden size): checked then."""
    if isinstance(value, dict):
        # the hdet block keeps its own: HDETConfig reads or refuses them (total_steps by
        # resolve_auto; dropped, replicas "auto" would end in a TypeError)
        return {k: v if k == "hdet" else _without_auto(v) for k, v in value.items() if v != "auto"}
    return value


def _auto_paths(value: Any, prefix: str = "") -> list[str]:
    """The dotted keys of ``value`` whose value is ``"auto"``."""
    if not isinstance(value, dict):
        return []
    out = []
    for k, v in value.items():
        out += [f"{prefix}{k}"] if v == "auto" else _auto_paths(v, f"{prefix}{k}.")
    return out


def without_trainer_autos(config: dict) -> tuple[dict, list[str]]:
    """``(config without the "auto" values Trainer fills, their dotted keys)``, as
    :class:`~hdet_scale.hf.HDETTrainer` checks a DeepSpeed file before training
    (``hdet-dryrun``). ``hdet.schedule.total_steps: "auto"`` is kept (the run length,
    which ``--total-steps`` stands for). ``config`` itself is not changed."""
    autos = [p for p in _auto_paths(config) if not p.startswith("hdet.")]
    if not autos:
        return config, []
    return _without_auto(config), autos


def _checkable(ds_config: dict, max_steps: int | None) -> dict:
    """``ds_config`` as the checks take it before training starts: the hdet block's
    ``"auto"`` run length resolved (:func:`resolve_auto`), ``Trainer``'s other autos left
    out (:func:`_without_auto`), and, while the run length is still unknown, a stand-in
    too long for any check to fail on (the checks that need it run again at ``train()``)."""
    ds = _without_auto(resolve_auto(ds_config, max_steps))
    if ((ds_config.get("hdet") or {}).get("schedule") or {}).get("total_steps") == "auto" and max_steps is None:
        # the longest run the checks accept (2**62 is refused as over 2**53, which would
        # fail every epoch-based Trainer run at construction)
        ds["hdet"].setdefault("schedule", {})["total_steps"] = MAX_STEPS
    return ds


def check_run_length(block: Any, max_steps: int | None) -> None:
    """An explicit ``hdet.schedule.total_steps`` against the ``Trainer``'s optimizer steps
    (``max_steps``, known at construction when ``TrainingArguments.max_steps`` is set,
    else when ``train()`` starts), as ``hdet-train`` holds it to ``train.steps`` (4
    against 6 would train 4 steps, then both ranks die in the scheduler; 100 against 6
    would never leave the warm-up, without a word).

    Raises:
        HDETConfigError: ``total_steps`` shorter than the run. Warns (``UserWarning``)
        when it is longer: the run covers the schedule's start only.
    """
    schedule = (block or {}).get("schedule") if isinstance(block, dict) else None
    total = schedule.get("total_steps") if isinstance(schedule, dict) else None
    if max_steps is None or max_steps < 1 or not isinstance(total, int) or isinstance(total, bool):
        return
    if total < max_steps:
        raise HDETConfigError(f"hdet.schedule.total_steps: {total} is shorter than the Trainer's {max_steps} "
                              "optimizer steps (max_steps, or epochs x steps per epoch); set it to \"auto\" (the "
                              "Trainer's run length) or to at least that")
    if total > max_steps:
        warnings.warn(f"hdet.schedule.total_steps={total} > the Trainer's {max_steps} optimizer steps: the run "
                      f"covers the schedule's first {max_steps} steps only and ends before its LR anneals (set it "
                      "to \"auto\" to run the whole schedule)", UserWarning, stacklevel=3)


def resolve_auto(ds_config: dict, max_steps: int | None) -> dict:
    """``ds_config`` with ``hdet.schedule.total_steps: "auto"`` set to ``max_steps``
    (``Trainer``'s optimizer steps; ``None`` while unknown: then left out, and
    :class:`HDETConfig` supplies its check when training starts)."""
    ds = copy.deepcopy(ds_config)
    schedule = ((ds.get("hdet") or {}).get("schedule") or {})
    if schedule.get("total_steps") == "auto":
        if max_steps is None or max_steps < 1:
            del schedule["total_steps"]
        else:
            schedule["total_steps"] = int(max_steps)
    return ds


def ignored_scheduler_args(args: Any) -> str | None:
    """The ``TrainingArguments`` scheduler settings an HDET run does not use, in one
    warning text, or ``None``: ``lr_scheduler_type`` other than its default ``linear``,
    ``lr_scheduler_kwargs``, ``warmup_steps`` / ``warmup_ratio`` above 0. ``hdet.schedule``
    sets the LR (docs/hf_trainer.md says so; at run time only this warning does)."""
    kind = getattr(args, "lr_scheduler_type", "linear")
    kind = getattr(kind, "value", kind)
    set_ = []
    if kind not in (None, "linear"):
        set_.append(f"lr_scheduler_type={kind!r}")
    if getattr(args, "lr_scheduler_kwargs", None):
        set_.append(f"lr_scheduler_kwargs={args.lr_scheduler_kwargs!r}")
    for name in ("warmup_steps", "warmup_ratio"):
        value = getattr(args, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            set_.append(f"{name}={value!r}")
    if not set_:
        return None
    return (f"TrainingArguments {', '.join(set_)}: not used with an hdet block; the LR follows hdet.schedule "
            "(name, pct_start or warmup_steps, total_steps: docs/config.md)")


def check_trainer_values(hf_ds_config: Any) -> None:
    """Refuse the DeepSpeed values that disagree with ``TrainingArguments`` before HDET's
    own checks see them (else ``"gradient_accumulation_steps": 4`` against
    ``TrainingArguments(gradient_accumulation_steps=2)`` is reported as a
    ``train_batch_size`` the user never wrote, the one ``Trainer`` had filled for
    ``"auto"``). The list is transformers' own: ``HfTrainerDeepSpeedConfig.trainer_config_process``
    (run when ``TrainingArguments`` is built) records each explicit value that differs
    (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
    ``train_batch_size``, the optimizer's, ...) and ``Trainer`` refuses them only when
    training starts (``trainer_config_finalize``).

    Raises:
        HDETConfigError: one line naming each disagreement (DeepSpeed's value and
            ``TrainingArguments``') and the fix.
    """
    mismatches = getattr(hf_ds_config, "mismatches", None) or ()
    found = list(dict.fromkeys(str(m).lstrip("- ").strip() for m in mismatches))
    if found:
        raise HDETConfigError("TrainingArguments(deepspeed=...): the DeepSpeed config disagrees with "
                              f"TrainingArguments ({'; '.join(found)}); set these DeepSpeed values to \"auto\" "
                              "(Trainer fills them from TrainingArguments) or give TrainingArguments the same values")


_NO_TOTAL_STEPS = "must be an integer >= 1 (optimizer steps in the run), got None"


def explain_total_steps(err: HDETConfigError) -> HDETConfigError:
    """``err`` with its ``hdet.schedule.total_steps ... got None`` line (the block sets no
    run length) told what :class:`~hdet_scale.hf.HDETTrainer` takes instead; ``err``
    itself when it has no such line."""
    text = str(err)
    if _NO_TOTAL_STEPS not in text:
        return err
    return HDETConfigError(text.replace(_NO_TOTAL_STEPS, "not set; with HDETTrainer write \"total_steps\": \"auto\" "
                                        "in hdet.schedule (the Trainer's optimizer steps: TrainingArguments.max_steps, "
                                        "or epochs x steps per epoch) or a number of optimizer steps"))


def check_deepspeed_file(args: Any) -> None:
    """``TrainingArguments(deepspeed="ds.json")``'s file read again with the reader
    ``hdet-train``, ``hdet-dryrun`` and :func:`hdet_scale.prepare` use
    (:func:`hdet_scale.ds_json.loads_json`): transformers' ``json.load`` keeps the last of
    a key given twice, so a file with two ``"hdet"`` blocks would train with the second
    without a word where the other entry points refuse it. A dict, or a
    string that is not a file (transformers also takes base64 JSON), is left alone.

    Raises:
        HDETConfigError: naming the file and the repeated key.
    """
    import os

    from hdet_scale.ds_json import RepeatedKeyError, loads_json

    path = getattr(args, "deepspeed", None)
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            loads_json(f.read())
    except RepeatedKeyError as e:
        raise HDETConfigError(f"TrainingArguments(deepspeed={os.fspath(path)!r}): the file {e}") from None
    except (OSError, ValueError):
        return  # transformers read it already; its own errors are its own
