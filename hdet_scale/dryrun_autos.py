"""``hdet-dryrun`` on a DeepSpeed JSON written for ``HDETTrainer``: the ``"auto"`` values the
Hugging Face Trainer fills from ``TrainingArguments`` are left out of the checks, as
``HDETTrainer`` checks the file (one note naming them), and an error about one of them
says where its real value comes from. Split from ``dryrun.py``."""

from __future__ import annotations

import sys


def trainer_autos_left_out(config: dict) -> tuple[dict, list[str]]:
    """A file written for ``HDETTrainer`` checked as it checks it, without the ``"auto"``
    values the Hugging Face Trainer fills (each would be an error here, so such a file
    could not be dry-run), with one note naming them."""
    from hdet_scale.hf_config import without_trainer_autos

    config, autos = without_trainer_autos(config)
    if autos:
        print(f"hdet-dryrun: note: {len(autos)} value(s) are \"auto\" ({', '.join(autos[:5])}"
              f"{', ...' if len(autos) > 5 else ''}): the Hugging Face Trainer fills them from TrainingArguments "
              "(HDETTrainer, docs/hf_trainer.md); checked without them, as HDETTrainer checks the file, so the "
              "report uses the defaults where they are missing (hdet-train and hdet_scale.prepare refuse them)",
              file=sys.stderr, flush=True)
    return config, autos


def auto_hints(path: str, error: str) -> str:
    """For each ``optimizer.params`` value the file leaves ``"auto"`` that ``error`` is
    about (a weight_decay axis over a weight_decay of 0, where only
    ``TrainingArguments.weight_decay`` decides), one line saying that the check used the
    optimizer's default and ``HDETTrainer`` takes the Trainer's value; ``""`` if none."""
    from hdet_scale.backends.ds_prepare import read_for_check
    from hdet_scale.hf_config import without_trainer_autos

    try:
        _, autos = without_trainer_autos(read_for_check(path))
    except Exception:  # noqa: BLE001 - a hint is not worth a second error: the first is said
        return ""
    hints = []
    for key in autos:
        name = key.rsplit(".", 1)[-1]
        if key.startswith("optimizer.params.") and f"a {name} of 0" in error:
            hints.append(f"\n  {key} is \"auto\" in the file: checked with the optimizer's default 0 here; "
                         f"HDETTrainer takes TrainingArguments.{name} (Hugging Face's default 0.0 is refused the "
                         f"same way): set {name} > 0 there, and dry-run a copy of the file with that value")
    return "".join(hints)
