"""``HDETTrainer(...)`` at construction, in this process (gloo, world of one): what it says
about a missing block, a DeepSpeed value that disagrees with ``TrainingArguments``, an
``fsdp_config`` block beside a DeepSpeed config, and a block without ``total_steps``.

The Trainer, Accelerate and DeepSpeed's config are the real ones; no step is trained (each
case is decided before ``train()``, a few seconds for the module).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import hf_workers as H  # noqa: E402

from hdet_scale.errors import HDETConfigError  # noqa: E402


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A gloo group of one rank (``TrainingArguments(deepspeed=...)`` needs one), and,
    afterwards, Accelerate's, transformers' and DeepSpeed's process-wide state cleared and
    the environment restored (Accelerate leaves ``ACCELERATE_USE_DEEPSPEED=true``, which
    later spawned ranks inherit: a plain FSDP ``Trainer`` there would see DeepSpeed on)."""
    import torch.distributed as dist

    environ = dict(os.environ)
    store = tmp_path_factory.mktemp("hf_world") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        from accelerate.state import AcceleratorState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)
        try:
            import deepspeed.comm.comm as ds_comm

            ds_comm.cdb = None
        except ImportError:  # pragma: no cover - deepspeed layout
            pass
        dist.destroy_process_group()
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)


def _args(tmp_path, deepspeed=None, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=4, report_to=[], ddp_backend="gloo", use_cpu=True, disable_tqdm=True)
    return TrainingArguments(deepspeed=deepspeed, **{**base, **kw})


def _block() -> dict:
    return {**H.hdet_block(0.2, False), "replicas": 1}


def _trainer(args):
    from hdet_scale.hf import HDETTrainer

    return HDETTrainer(model=H.build_model(), args=args, train_dataset=H.Progressions())


def _no_block_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "found no hdet block" in str(w.message)]


@pytest.mark.parametrize("ds", [H.ds_config(None), {**H.ds_config(None), "hdet": None}, None],
                         ids=["no-key", "null", "no-deepspeed"])
def test_a_trainer_without_a_block_warns_that_hdet_is_off(world_of_one, tmp_path, ds):
    """Without an ``hdet`` block (no key, ``"hdet": null``, or no DeepSpeed config nor
    ``fsdp_config`` block) HDETTrainer trains as a plain Trainer, and warns once, naming
    where it looked; ``"enabled": false`` stays silent."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _trainer(_args(tmp_path, ds))
    assert not trainer._hdet_enabled
    said = _no_block_warnings(record)
    assert len(said) == 1, [str(w.message) for w in record]
    assert "TrainingArguments.deepspeed" in said[0] and "fsdp_config" in said[0], said[0]
    assert "plain Trainer" in said[0] and "transformers.Trainer" in said[0], said[0]

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _trainer(_args(tmp_path, {**H.ds_config(None), "hdet": {"enabled": False}}))
    assert _no_block_warnings(record) == []


def test_a_deepspeed_value_that_disagrees_with_training_arguments_is_named(world_of_one, tmp_path):
    """``"gradient_accumulation_steps": 4`` in the JSON against
    ``TrainingArguments(gradient_accumulation_steps=2)`` is refused naming both values
    and the fix, not as a ``train_batch_size`` the user never wrote (Trainer fills its
    "auto")."""
    ds = {**H.ds_config(_block()), "gradient_accumulation_steps": 4}
    with pytest.raises(HDETConfigError) as err:
        _trainer(_args(tmp_path, ds))
    text = str(err.value)
    assert "gradient_accumulation_steps=4" in text and "gradient_accumulation_steps=2" in text, text
    assert "'auto'" in text or '"auto"' in text, text
    assert "train_batch_size" not in text, text
    assert "\n" not in text.strip(), text


def test_an_fsdp_config_block_beside_a_deepspeed_config_is_refused(world_of_one, tmp_path):
    """An ``hdet`` block in ``fsdp_config`` beside ``deepspeed=`` is refused: it would
    be ignored without a word (the DeepSpeed JSON's block, or none, used)."""
    for ds in (H.ds_config(_block()), H.ds_config(None)):
        args = _args(tmp_path, copy.deepcopy(ds), fsdp_config={"hdet": _block()})
        with pytest.raises(HDETConfigError) as err:
            _trainer(args)
        text = str(err.value)
        assert "fsdp_config" in text and "TrainingArguments.deepspeed" in text and "DeepSpeed" in text, text


def test_a_deepspeed_file_with_two_hdet_blocks_is_refused(world_of_one, tmp_path):
    """``TrainingArguments(deepspeed="ds.json")`` with ``"hdet"`` twice would train with
    the second block (transformers' ``json.load`` keeps the last) while hdet-train,
    prepare() and hdet-dryrun refuse the file: refused, naming the file and the key; the
    same file with one block builds."""
    import json

    first, second = {**_block(), "axes": {"lr": {"spread_ratio": 0.5}}}, _block()
    body = json.dumps(H.ds_config(None))[:-1]  # the object without its closing brace
    path = tmp_path / "ds.json"
    path.write_text(f'{body}, "hdet": {json.dumps(first)}, "hdet": {json.dumps(second)}}}')
    with pytest.raises(HDETConfigError) as err:
        _trainer(_args(tmp_path, str(path)))
    text = str(err.value)
    assert str(path) in text and "'hdet' twice" in text, text
    path.write_text(f'{body}, "hdet": {json.dumps(second)}}}')
    assert _trainer(_args(tmp_path, str(path)))._hdet_enabled


def test_a_jsonl_path_rank_0_could_not_open_is_refused_at_construction(world_of_one, tmp_path):
    """``hdet.logging.jsonl`` naming a folder would train under HDETTrainer on DeepSpeed
    until rank 0's first record (IsADirectoryError; the other ranks a lost peer), and
    ``/dev/null`` would throw the metrics away without a word; prepare() refuses both,
    and HDETTrainer refuses them at construction, naming the key."""
    for bad, says in ((tmp_path, "is a folder"), ("/dev/null", "not a regular file")):
        block = {**_block(), "logging": {"jsonl": str(bad)}}
        with pytest.raises(HDETConfigError, match="hdet.logging.jsonl") as err:
            _trainer(_args(tmp_path, H.ds_config(block)))
        assert says in str(err.value), err.value
    good = {**_block(), "logging": {"jsonl": str(tmp_path / "m.jsonl")}}
    assert _trainer(_args(tmp_path, H.ds_config(good)))._hdet_enabled


def test_an_auto_value_in_the_hdet_block_is_refused_naming_its_key(world_of_one, tmp_path):
    """``"replicas": "auto"`` is not dropped with the Trainer's autos (a one-replica
    warning, then a TypeError on every rank); only ``schedule.total_steps`` is the
    Trainer's to fill. Refused at construction, naming the key."""
    block = {**_block(), "replicas": "auto"}
    with pytest.raises(HDETConfigError, match="hdet.replicas"):
        _trainer(_args(tmp_path, H.ds_config(block)))
    from hdet_scale.hf_config import without_trainer_autos

    _, autos = without_trainer_autos({"optimizer": {"params": {"lr": "auto"}}, "hdet": {"replicas": "auto"}})
    assert autos == ["optimizer.params.lr"]


def test_a_schedule_shorter_than_the_run_is_named_as_such_first(world_of_one, tmp_path):
    """``total_steps`` 3 against ``max_steps`` 4 with a one-cycle warm-up is refused by
    the run-length check first, naming max_steps and the fix, not for ``pct_start`` (the
    warm-up's own check)."""
    block = _block()
    block["schedule"] = {"name": "onecycle", "total_steps": 3, "pct_start": 0.3}
    with pytest.raises(HDETConfigError) as err:
        _trainer(_args(tmp_path, H.ds_config(block), max_steps=4))
    text = str(err.value)
    assert text.startswith("hdet.schedule.total_steps: 3 is shorter than the Trainer's 4 optimizer steps"), text


@pytest.mark.parametrize("max_steps", [4, -1])
def test_a_block_without_total_steps_is_told_about_auto(world_of_one, tmp_path, max_steps):
    """``"hdet": {}`` names the fix for HDETTrainer, ``"total_steps": "auto"`` (the
    Trainer's optimizer steps) or a number, not ``total_steps ... got None``."""
    ds = H.ds_config({"replicas": 1})
    with pytest.raises(HDETConfigError) as err:
        _trainer(_args(tmp_path, ds, max_steps=max_steps, num_train_epochs=1))
    text = str(err.value)
    assert "hdet.schedule.total_steps" in text and '"total_steps": "auto"' in text, text
    assert "max_steps" in text and "got None" not in text, text


def test_a_config_warning_is_given_once_though_the_block_is_checked_twice(world_of_one, tmp_path):
    """"total_steps": 100 with max_steps=6 warns once per rank: the block is checked at
    construction and again when train() starts (``_prepare_for_training``, which calls
    the same check). The second check gives it no more; the first gives it once."""
    block = {**_block(), "schedule": {"name": "constant", "total_steps": 100}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _trainer(_args(tmp_path, H.ds_config(block)))
        trainer._check(4)  # what train() runs (max_steps=4)
    said = [str(w.message) for w in record if "> the Trainer's 4 optimizer steps" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in record]


def test_an_epoch_based_run_takes_its_length_from_the_epochs(world_of_one, tmp_path, monkeypatch):
    """With ``num_train_epochs`` and no ``max_steps``, ``"total_steps": "auto"`` is not
    refused at construction as "must be at most 2**53 ... got 4611686018427387904" (the
    stand-in for a run length not known yet): the Trainer builds, and ``train()`` gives
    the schedule the epochs' optimizer steps: 128 sequences, 2 per device, accumulation
    2 on one rank = 32 per epoch."""
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)  # DeepSpeed's engine reads them (a launcher sets them)
    block = {**_block(), "schedule": {"name": "constant", "total_steps": "auto"}}
    trainer = _trainer(_args(tmp_path, H.ds_config(block), max_steps=-1, num_train_epochs=1, save_strategy="no"))
    trainer.train()
    assert trainer.state.global_step == 32
    assert trainer.hdet_scheduler.config.schedule.total_steps == 32
    assert trainer.hdet_scheduler.step_count == 32


def test_hdet_wandb_beside_the_trainers_wandb_callback_is_refused_at_construction(world_of_one, tmp_path):
    """``hdet.logging.wandb.enabled`` with ``report_to=["wandb"]`` would crash rank 0 at
    train start (the Trainer's WandbCallback cannot update the config beside HDET's own
    W&B run): refused when the HDETTrainer is built, naming both settings and the two
    ways out; either alone is accepted."""
    pytest.importorskip("wandb")
    block = {**_block(), "logging": {"wandb": {"enabled": True, "mode": "offline", "dir": str(tmp_path)}}}
    with pytest.raises(HDETConfigError, match=r"^hdet.logging.wandb.enabled=true beside "
                                              r"TrainingArguments\(report_to=\['wandb'\]\)"):
        _trainer(_args(tmp_path, H.ds_config(block), report_to=["wandb"]))
    _trainer(_args(tmp_path, H.ds_config(block)))  # HDET's W&B alone
    plain = {**_block(), "logging": {"wandb": {"enabled": False}}}
    os.environ["WANDB_MODE"] = "offline"  # the callback's run, if it ever started (it does not here)
    _trainer(_args(tmp_path, H.ds_config(plain), report_to=["wandb"]))  # the Trainer's alone


def test_evaluate_before_train_is_named_not_an_attribute_error(world_of_one, tmp_path, monkeypatch):
    """``evaluate()`` before ``train()`` would build DeepSpeed's inference engine, and
    ``train()`` then fail with ``AttributeError: 'NoneType' object has no attribute
    'total_steps'`` (the plain Trainer fails there too, at its first backward), or
    Accelerate's ValueError on an "auto" total_steps: evaluate() and predict() before
    train() are an HDETConfigError naming the order and the way out, before anything is
    built: train() then trains, and evaluate() after it works."""
    from hdet_scale.hf import HDETTrainer

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)  # DeepSpeed's engine reads them (a launcher sets them)
    trainer = HDETTrainer(model=H.build_model(), args=_args(tmp_path, H.ds_config(_block()), save_strategy="no"),
                          train_dataset=H.Progressions(), eval_dataset=H.Progressions())
    for call in (trainer.evaluate, trainer.predict):
        with pytest.raises(HDETConfigError, match=r"^HDETTrainer.(evaluate|predict)\(\) before train\(\): on "
                                                  r"DeepSpeed it builds an inference engine"):
            call(H.Progressions()) if call == trainer.predict else call()
    trainer.train()  # nothing was built: the run trains
    assert trainer.hdet_scheduler.step_count == 4
    assert "eval_loss" in trainer.evaluate()  # after train(): the Trainer's own evaluation
