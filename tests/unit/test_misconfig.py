"""Silent misconfiguration: each case below would run without a word, and is refused or named.

- unknown DeepSpeed keys (``hdet_scale.ds_keys``): an ``"hdett"`` block, a top-level typo,
  a typo inside a DeepSpeed block, a misspelt optimizer argument; and no finding on the
  repository's configs and a Hugging Face-style config (no false alarms);
- duplicate indices in ``axes.<name>.groups``;
- the ``"paper"`` controller on a ``constant`` schedule, floored at the peak;
- a loss of the wrong type handed to the scheduler (DeepSpeed's TypeError fallback would
  record ``train_batch_size`` as the loss);
- ``hdet/converge_s`` read before the device finished the converge;
- the W&B logger finishing a run the user had opened;
- one replica with a spread or auto-LR (HDET does nothing);
- a DeepSpeed block given as a value (``"bf16": true``), a key given twice in the run
  YAML or the DeepSpeed JSON, a trainer section given as a value (``train=[1,2]``), and
  the hdet block's ``logging`` in ``hdet-train``.

Expected values are computed by hand; float comparisons use rel=1e-12 (the same float64
operations in a different order). The W&B test runs wandb offline in a temp folder.
"""

from __future__ import annotations

import glob
import json
import math
import re
import os
import threading
import time
import warnings

import pytest
import torch

from hdet_scale.autolr import Controller, build_schedule, check_config
from hdet_scale.config import HDETConfig, WandbConfig
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETConfigError
from hdet_scale.reference import _LocalSync
from test_scheduler import LocalSync  # noqa: E402  (tests/unit is on sys.path under pytest)


@pytest.fixture(autouse=True)
def _own_working_dir(tmp_path, monkeypatch):
    """hdet-train's default run_dir is relative (runs/default): a run the user made in the
    folder pytest starts from must not change these tests, nor these tests write there."""
    monkeypatch.chdir(tmp_path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGED = os.path.join(ROOT, "hdet_scale", "train", "configs", "deepspeed.json")


ADAMW = os.path.join(ROOT, "configs", "deepspeed_cpu_2x2_adamw.json")  # the same job on AdamW + OneCycle


def packaged(path: str = PACKAGED) -> dict:
    """The trainer's DeepSpeed JSON (or ``path``), with the run length hdet-train would fill in."""
    with open(path) as f:
        ds = json.load(f)
    ds["hdet"]["schedule"]["total_steps"] = 100
    return ds


# ---- unknown DeepSpeed keys ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_keys():
    pytest.importorskip("deepspeed")
    from hdet_scale import ds_keys

    return ds_keys


@pytest.mark.parametrize("name", ["hdett", "HDET", "hdet_config", "hdt"])
def test_hdet_lookalike_is_an_error_in_the_library(ds_keys, name):
    """The library's own entry point refuses it (it would train plain DeepSpeed)."""
    from hdet_scale.backends.deepspeed import prepare_config

    ds = packaged()
    ds[name] = ds.pop("hdet")
    with pytest.raises(HDETConfigError, match=rf"{name}: .*did you mean 'hdet'\?.*plain DeepSpeed"):
        prepare_config(ds, world_size=4)


def test_unknown_deepspeed_key_warns_in_the_library_and_fails_strict(ds_keys):
    """DeepSpeed ignores the misspelt key: its own parser keeps the default (None), so the
    run would silently use another batch size. The library warns naming the closest key;
    strict mode (hdet-train, hdet-dryrun) refuses."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from hdet_scale.backends.deepspeed import prepare_config

    ds = packaged()
    ds["train_micro_batch_size_per_gpuu"] = ds.pop("train_micro_batch_size_per_gpu")  # 8
    plain = {k: v for k, v in ds.items() if k != "hdet"}
    # One process (world size 1): DeepSpeed derives the micro-batch from train_batch_size,
    # ignoring the misspelt 8.
    assert DeepSpeedConfig({**plain, "train_batch_size": 4}).train_micro_batch_size_per_gpu == 4
    with pytest.warns(UserWarning, match=r"train_micro_batch_size_per_gpuu: .*did you mean "
                                         r"'train_micro_batch_size_per_gpu'\?"):
        prepare_config(ds, world_size=4)
    with pytest.raises(HDETConfigError, match=r"deepspeed\.train_micro_batch_size_per_gpuu: .*did you mean"):
        ds_keys.check_deepspeed_keys(ds, strict=True, prefix="deepspeed.")


@pytest.mark.parametrize("block,key,value,needle", [
    # pydantic blocks: DeepSpeed refuses them itself, in initialize on every rank: an error everywhere
    ("zero_optimization", "stagee", 3, r"zero_optimization\.stagee: unknown key, DeepSpeed refuses it; "
                                       r"did you mean 'stage'\?"),
    ("bf16", "enabledd", True, r"bf16\.enabledd: .*did you mean 'enabled'\?"),
    ("wandb", "projectt", "x", r"wandb\.projectt: .*did you mean 'project'\?"),
])
def test_key_deepspeed_refuses_is_an_error_in_the_library(ds_keys, block, key, value, needle):
    from hdet_scale.backends.deepspeed import prepare_config

    ds = packaged()
    ds.setdefault(block, {})[key] = value
    with pytest.raises(HDETConfigError, match=needle):
        prepare_config(ds, world_size=4)


def test_nested_typos_and_optimizer_arguments_all_named_at_once(ds_keys):
    """Keys DeepSpeed's non-pydantic readers never ask for, and an optimizer argument
    FusedAdam / DeepSpeedCPUAdam do not take (DeepSpeed would fail inside initialize
    with a TypeError), in one strict error; the closest valid key is named."""
    ds = packaged()
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}  # DeepSpeed's own Adam
    ds["activation_checkpointing"] = {"partition_activationss": True}
    ds["checkpoint"] = {"tag_validationn": "Warn"}
    ds["optimizer"]["params"]["learning_rate"] = ds["optimizer"]["params"].pop("lr")
    ds["optimizer"]["typ"] = "AdamW"
    with pytest.raises(HDETConfigError) as e:
        ds_keys.check_deepspeed_keys(ds, strict=True)
    text = str(e.value)
    for needle in ("activation_checkpointing.partition_activationss: unknown DeepSpeed key",
                   "did you mean 'partition_activations'?", "checkpoint.tag_validationn:",
                   "did you mean 'tag_validation'?", "optimizer.typ:", "did you mean 'type'?",
                   "optimizer.params.learning_rate: not an argument of deepspeed.FusedAdam",
                   "did you mean 'lr'?"):
        assert needle in text, (needle, text)


def test_no_false_alarm_on_real_configs(ds_keys):
    """Every DeepSpeed JSON in the repository, and a typical Hugging Face Trainer config
    (``"auto"`` values, offload, monitors, profiler), have no finding."""
    paths = glob.glob(os.path.join(ROOT, "configs", "*.json")) + [PACKAGED]
    assert len(paths) >= 3
    for path in paths:
        with open(path) as f:
            assert ds_keys.find_problems(json.load(f)) == ([], [], []), path
    hf = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                              "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
        "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                           "detailed": True, "output_file": None},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "number_checkpoints": None,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
        "data_types": {"grad_accum_dtype": "fp32"}, "zero_allow_untested_optimizer": True,
    }
    assert ds_keys.find_problems(hf) == ([], [], [])


def test_dryrun_refuses_hdett_instead_of_plain_deepspeed(ds_keys, tmp_path, capsys):
    from hdet_scale.dryrun import main

    ds = packaged()
    ds["hdett"] = ds.pop("hdet")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert main([str(path), "--world-size", "4", "--total-steps", "100"]) == 2
    err = capsys.readouterr().err
    assert "hdett" in err and "did you mean 'hdet'?" in err and "plain DeepSpeed" in err  # "...trains plain DeepSpeed"


# ---- DeepSpeed blocks given as a value ----------------------------------------------------

@pytest.mark.parametrize("key,value,line", [
    ("bf16", True, 'bf16: must be a JSON object, e.g. {"enabled": true}; got true'),
    ("fp16", [1], 'fp16: must be a JSON object, e.g. {"enabled": true}; got [1]'),
    ("zero_optimization", 5, 'zero_optimization: must be a JSON object, e.g. {"stage": 3}; got 5'),
    ("optimizer", "AdamW", 'optimizer: must be a JSON object, e.g. {"type": "AdamW", "params": {"lr": 0.001}}; '
                           'got "AdamW"'),
    ("activation_checkpointing", True, "activation_checkpointing: must be a JSON object (keys such as "
                                       "contiguous_memory_optimization, cpu_checkpointing, number_checkpoints); got true"),
    ("wandb", True, 'wandb: must be a JSON object, e.g. {"enabled": true}; got true'),  # a pydantic field
    ("zero_optimization.offload_param", "cpu", 'zero_optimization.offload_param: must be a JSON object, '
                                               'e.g. {"device": "cpu"}; got "cpu"'),  # nested, pydantic
])
def test_a_block_given_as_a_value_is_refused_in_the_library(ds_keys, key, value, line):
    """``"bf16": true`` and the like: DeepSpeed's config parser fails on them inside
    initialize, on every rank, with a TypeError or AttributeError naming no key (the trial
    parse reported only that, as a warning in the library). Refused everywhere now, with the
    dotted key and the form; compared with the same config holding the block as an object
    (no finding), and with DeepSpeed itself failing on the value."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from hdet_scale.backends.deepspeed import prepare_config

    ds = packaged()
    *parents, last = key.split(".")
    node = ds
    for part in parents:
        node = node[part]
    assert ds_keys.find_problems(ds) == ([], [], [])  # the block as an object (or absent): fine
    node[last] = value
    plain = {k: v for k, v in ds.items() if k != "hdet"}
    with pytest.raises(Exception) as raw:  # DeepSpeed's own answer: no key named, or not as the key
        DeepSpeedConfig({**plain, "train_batch_size": 8})
    assert f"{key}: must be a JSON object" not in str(raw.value)
    with pytest.raises(HDETConfigError) as e:
        prepare_config(ds, world_size=4)
    assert str(e.value).splitlines()[1:] == [f"  {line}"], str(e.value)
    with pytest.raises(HDETConfigError, match=rf"deepspeed\.{key}: must be a JSON object"):
        ds_keys.check_deepspeed_keys(ds, strict=True, prefix="deepspeed.")


@pytest.mark.parametrize("key,value", [("zero_optimization", True), ("aio", None)])
def test_a_value_form_deepspeed_takes_is_not_refused(ds_keys, key, value):
    """No false alarm: DeepSpeed 0.19 still takes ``"zero_optimization": true`` (its
    deprecated form) and ``"aio": null``; only values it fails on are refused."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = {"train_micro_batch_size_per_gpu": 1, key: value}
    DeepSpeedConfig(dict(ds))  # DeepSpeed parses it
    hdet_like, refused, unknown = ds_keys.find_problems(ds)
    assert not any("must be a JSON object" in line for line in refused + unknown), (refused, unknown)


# ---- the trainer's run config ---------------------------------------------------------------

def _run_config_error(path=None, overrides=()) -> str:
    from hdet_scale.train.config import load_run_config

    with pytest.raises(HDETConfigError) as e:
        load_run_config(str(path) if path else None, list(overrides))
    return str(e.value)


@pytest.mark.parametrize("text,message", [
    ("train:\n  steps: 10\ntrain:\n  steps: 20\n", "sets train twice (lines 1 and 3)"),
    ("run_dir: a\nmodel:\n  hidden_size: 64\n  num_layers: 2\n  hidden_size: 32\n",
     "sets model.hidden_size twice (lines 3 and 5)"),
    ("train: {steps: 10, steps: 20}\n", "sets train.steps twice (lines 1 and 1)"),
])
def test_a_key_given_twice_in_the_yaml_is_named_with_its_lines(tmp_path, text, message):
    """OmegaConf refused the file with a raw yaml ConstructorError traceback (PyYAML alone
    keeps the last value silently)."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert _run_config_error(path) == f"config file {str(path)!r} {message}: keep one (YAML does not say which would win)"


def test_a_key_given_twice_in_the_deepspeed_json_is_named(tmp_path):
    """json keeps the last value silently; DeepSpeed, reading the file itself, refuses it."""
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "type": "Adam"}}')
    msg = _run_config_error(overrides=[f"deepspeed_config={path}"])
    assert "ds.json" in msg and "the key 'type' twice in one object" in msg


@pytest.mark.parametrize("where,value,line", [
    ("override", "[1,2]", "train: must be a mapping of train.* keys, e.g. train.steps=100; got [1, 2]"),
    ("override", "null", "train: must be a mapping of train.* keys, e.g. train.steps=100; got null"),
    ("yaml", "[1, 2]", "train: must be a mapping of train.* keys, e.g. train: {steps: 100}; got [1, 2]"),
    ("yaml", "5", "train: must be a mapping of train.* keys, e.g. train: {steps: 100}; got 5"),
])
def test_a_section_given_as_a_value_is_named(tmp_path, where, value, line):
    """OmegaConf's merge error ("list is not a subclass of TrainConfig") named no key."""
    if where == "yaml":
        path = tmp_path / "run.yaml"
        path.write_text(f"train: {value}\n")
        assert _run_config_error(path) == f"config file {str(path)!r}: {line}"
    else:
        assert _run_config_error(overrides=[f"train={value}"]) == line


@pytest.mark.parametrize("value", ['"false"', '"auto"', "0", "null"])
def test_a_precision_switch_that_is_not_a_boolean_is_refused(value):
    """``bf16.enabled: "false"`` is false on every code path that reads the switch: each
    gets a JSON boolean (hdet-train and hdet-dryrun, ``check_deepspeed_values``, and the
    library's engine check, whose message does not call the string bf16). Read as
    Python's truth it would train FSDP2 in bf16 where DeepSpeed trains in fp32
    (pydantic's), ddp would refuse it as bf16 and a resume would call it a precision
    change."""
    from hdet_scale.ds_values import check_deepspeed_values
    from hdet_scale.engine_config import check_engine_config

    msg = _run_config_error(overrides=[f"deepspeed.bf16.enabled={value}", "backend=fsdp2"])
    assert "deepspeed.bf16.enabled: must be true or false (a JSON boolean), got" in msg, msg
    assert ("filled by the Hugging Face Trainer" in msg) == (value == '"auto"'), msg
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": json.loads(value)},
          "zero_optimization": {"zero_quantized_weights": "no"}}
    with pytest.raises(HDETConfigError) as e:
        check_deepspeed_values(ds)
    assert "zero_optimization.zero_quantized_weights: must be true or false (a JSON boolean), got 'no'" in str(e.value)
    with pytest.raises(HDETConfigError) as e:
        check_engine_config(ds, "ddp", 2)
    assert "bf16.enabled: must be true or false" in str(e.value) and "trains in float32" not in str(e.value)
    assert "quantized communication" not in str(e.value)
    for ok in (True, False):  # the booleans pass both checks (ddp in fp32)
        check_deepspeed_values({"bf16": {"enabled": ok}})
    check_engine_config({"optimizer": {"type": "AdamW"}, "bf16": {"enabled": False}}, "ddp", 2)


@pytest.mark.parametrize("override,line", [
    ("deepspeed.hdet.schedule=5", "deepspeed.hdet.schedule: expected an object, got int 5"),  # was an AttributeError
    ("deepspeed.hdet.schedule.total_steps=abc", "deepspeed.hdet.schedule.total_steps: expected int | None, "
                                                "got 'abc'"),  # was a TypeError ('<' between str and int)
])
def test_a_schedule_of_the_wrong_type_is_one_line(override, line):
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run = load_run_config(None, [override, "wandb.enabled=false"])
    with pytest.raises(HDETConfigError) as e:
        validate(run, 4)
    assert str(e.value).splitlines()[1:] == [f"  {line}"], str(e.value)


def test_hdet_logging_wandb_is_the_default_of_the_trainers_wandb(tmp_path, monkeypatch, capsys):
    """``deepspeed.hdet.logging.wandb.*`` (a DeepSpeed JSON written for the library) was
    ignored by hdet-train without a word. Its keys are now the defaults of the trainer's
    ``wandb.*`` (the same WandbConfig keys); a key the run config sets wins. Compared with
    the same run without the block. ``logging.jsonl`` has no trainer counterpart: one
    warning, from the launcher only (not on a rank > 0 under torchrun)."""
    from hdet_scale.train.config import load_run_config

    monkeypatch.delenv("RANK", raising=False)
    plain = load_run_config(None, [])
    block = {"project": "from-json", "mode": "offline", "group": "g"}
    given = [f"deepspeed.hdet.logging.wandb.{k}={v}" for k, v in block.items()]
    run = load_run_config(None, given)
    assert run["wandb"] == {**plain["wandb"], **block}
    path = tmp_path / "run.yaml"
    path.write_text("wandb:\n  project: from-yaml\n")
    run = load_run_config(str(path), [*given, "wandb.mode=online"])
    assert run["wandb"] == {**plain["wandb"], "project": "from-yaml", "mode": "online", "group": "g"}
    assert capsys.readouterr().err == ""  # no jsonl: no warning
    load_run_config(None, ["deepspeed.hdet.logging.jsonl=m.jsonl", "run_dir=runs/x"])
    assert capsys.readouterr().err == (
        "hdet-train: warning: deepspeed.hdet.logging.jsonl='m.jsonl' is not used by hdet-train: it writes its "
        "metrics to run_dir/metrics.jsonl (runs/x/metrics.jsonl); choose the folder with run_dir=...\n")
    monkeypatch.setenv("RANK", "1")
    load_run_config(None, ["deepspeed.hdet.logging.jsonl=m.jsonl"])
    assert capsys.readouterr().err == ""


def test_wandb_keys_given_with_wandb_off_get_a_note(tmp_path, monkeypatch, capsys):
    """``wandb.project=myproj`` with ``wandb.enabled=false`` does not run without a
    word: one note names each wandb key the user gave (file or override), once (not on a
    rank > 0 under torchrun); none for wandb.enabled=false alone or with W&B on."""
    from hdet_scale.train.config import load_run_config

    monkeypatch.delenv("RANK", raising=False)
    load_run_config(None, ["wandb.enabled=false"])
    load_run_config(None, ["wandb.project=myproj"])
    assert capsys.readouterr().err == ""
    load_run_config(None, ["wandb.enabled=false", "wandb.project=myproj"])
    assert capsys.readouterr().err == (
        "hdet-train: note: wandb.project='myproj' is not used: wandb.enabled=false starts no W&B run (metrics go to "
        "run_dir/metrics.jsonl); set wandb.enabled=true to log to W&B\n")
    path = tmp_path / "run.yaml"
    path.write_text("wandb:\n  enabled: false\n  group: g\n")
    load_run_config(str(path), ["wandb.name=n"])
    assert capsys.readouterr().err.startswith("hdet-train: note: wandb.group='g', wandb.name='n' are not used: ")
    # the same keys from the hdet block's logging.wandb, named as given there
    load_run_config(None, ["wandb.enabled=false", "deepspeed.hdet.logging.wandb.project=foo"])
    assert capsys.readouterr().err.startswith(
        "hdet-train: note: deepspeed.hdet.logging.wandb.project='foo' is not used: wandb.enabled=false ")
    load_run_config(None, ["deepspeed.hdet.logging.wandb.project=foo"])  # the trainer's default: W&B on
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")
    load_run_config(str(path), ["wandb.name=n"])
    assert capsys.readouterr().err == ""


def test_wandb_environment_variables_set_the_keys_the_user_did_not(tmp_path, monkeypatch):
    """W&B's variables (``WANDB_PROJECT=envproj hdet-train``) set the keys neither the run
    config nor the hdet block sets (as the HF Trainer and ``wandb.init`` read them), so the
    run does not log to the packaged project ``hdet-scale`` without a word; a key the user
    gives wins. The real offline W&B run opened from the result is in the env's project."""
    wandb = pytest.importorskip("wandb")
    from hdet_scale.logging import MetricsLogger
    from hdet_scale.train.config import load_run_config

    plain = load_run_config(None, [])
    env = {"WANDB_PROJECT": "envproj", "WANDB_ENTITY": "envteam", "WANDB_RUN_GROUP": "envgroup", "WANDB_NAME": "envname"}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    run = load_run_config(None, [])
    assert run["wandb"] == {**plain["wandb"], "project": "envproj", "entity": "envteam", "group": "envgroup",
                            "name": "envname"}
    run = load_run_config(None, ["wandb.project=mine", "deepspeed.hdet.logging.wandb.group=json"])
    assert (run["wandb"]["project"], run["wandb"]["group"], run["wandb"]["name"]) == ("mine", "json", "envname")
    monkeypatch.delenv("WANDB_ENTITY")  # an entity W&B does not know fails offline too
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = load_run_config(None, [])
    logger = MetricsLogger(wandb=WandbConfig(**{**run["wandb"], "mode": "offline", "dir": str(tmp_path)}))
    try:
        assert (logger._wandb_run.project, logger._wandb_run.group, logger._wandb_run.name) == \
            ("envproj", "envgroup", "envname")
    finally:
        logger.close()
    assert wandb.run is None or wandb.run._is_finished
    # the library's logger: project unset reads WANDB_PROJECT too (wandb.init's own
    # default would be "uncategorized"), else "hdet"
    for env_project, expected in (("libproj", "libproj"), (None, "hdet")):
        if env_project is None:
            monkeypatch.delenv("WANDB_PROJECT")
        else:
            monkeypatch.setenv("WANDB_PROJECT", env_project)
        logger = MetricsLogger(wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path)))
        try:
            assert logger._wandb_run.project == expected
        finally:
            logger.close()


# ---- duplicate group indices ---------------------------------------------------------------

@pytest.mark.parametrize("axis,groups,twice", [("lr", [0, 0], [0]), ("weight_decay", [1, 0, 1], [1])])
def test_duplicate_group_indices_are_refused(axis, groups, twice):
    block = {"replicas": 2, "schedule": {"total_steps": 10}, "axes": {axis: {"spread_ratio": 0.1, "groups": groups}}}
    with pytest.raises(HDETConfigError, match=rf"hdet\.axes\.{axis}\.groups: lists parameter group\(s\) "
                                              rf"\[{twice[0]}\] more than once"):
        HDETConfig.from_dict(block)


# ---- the paper controller on a constant schedule -------------------------------------------

def test_paper_controller_can_lower_a_constant_schedule():
    """Constant schedule, peak 1, spread 0.5 over R = 2 (replica values 0.5 and 1.5), the
    low-LR replica better by 1 nat at temperature 0.1, momentum 0, lambda 0.5. The derived
    decay is 0 (start = floor = peak), so by hand ``h' = h + 0.5 * Delta`` with
    ``Delta = w0 h0 + w1 h1 - mean(h)``: the base must go *down* (not be floored at the
    peak), each sync by the same factor, until ``peak / max_factor``."""
    cfg = HDETConfig.from_dict({"replicas": 2, "sync_interval": 1, "axes": {"lr": {"spread_ratio": 0.5}},
                                "schedule": {"name": "constant", "total_steps": 100},
                                "auto": {"enabled": True, "controller": "paper", "fitness": "train_loss",
                                         "temperature": 0.1, "momentum": 0.0, "step_size": 0.5,
                                         "max_factor": 2.0}})
    key = ("lr", 0)
    ctl = Controller(cfg, build_schedule(cfg), [1.0], [key])
    assert ctl.decay[key] == 0.0
    w0 = 1 / (1 + math.exp(-10.0))  # softmax of scores (+5, -5)
    base, expected = 1.0, []
    for _ in range(4):
        applied = [0.5 * base, 1.5 * base]
        delta = w0 * applied[0] + (1 - w0) * applied[1] - base
        expected.append(max(base + 0.5 * delta, 0.5))  # floor: min(final LR 1.0, peak / max_factor 0.5)
        record: dict = {}
        ctl.update([1.0, 2.0], {key: [0, 1]}, {key: applied}, lambda k: base, record)
        base = ctl.base[key]
        assert base == pytest.approx(expected[-1], rel=1e-12)
    assert expected[0] == pytest.approx(0.75 + 0.5 * (1 - w0), rel=1e-12) and expected[0] < 1.0
    assert expected[-1] == 0.5 and record.get("hdet/lr/group_0/floored") == 1  # bounded below, not negative


# ---- the loss handed to the scheduler ------------------------------------------------------

def _single_replica_scheduler() -> tuple[HDETScheduler, _LocalSync]:
    cfg = HDETConfig.from_dict({"replicas": 1, "sync_interval": 5, "schedule": {"name": "constant",
                                                                                 "total_steps": 10}})
    sync = _LocalSync()  # the LossAccumulator every real rank's DistributedSync extends
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return HDETScheduler(cfg, {0: opt.param_groups}, sync), sync


@pytest.mark.parametrize("kwargs,needle", [
    ({"loss": "0.5"}, "got str '0.5'"),
    ({"loss": 32}, "train_batch_size"),                   # what DeepSpeed's TypeError fallback passes
    ({"loss": True}, "got bool True"),
    ({"loss": [0.5]}, "got list"),
    ({"loss": torch.ones(2)}, "shape (2,)"),
    ({"loss": torch.tensor(3)}, "dtype torch.int64"),
    ({"losss": 0.5}, "unexpected argument(s) ['losss']"),  # a misspelt lr_kwargs key was swallowed
])
def test_wrong_loss_is_refused_without_a_type_error_or_a_state_change(kwargs, needle):
    """DeepSpeed's engine catches a TypeError from ``lr_scheduler.step(**lr_kwargs)``
    and calls ``lr_scheduler.step(train_batch_size)``, so a TypeError for a str loss
    would record 32. A str loss is an HDETConfigError (a ValueError, which DeepSpeed
    does not catch): nothing recorded, the step not counted; a good loss after it is
    recorded exactly."""
    sched, sync = _single_replica_scheduler()
    with pytest.raises(HDETConfigError) as e:
        sched.step(**kwargs)
    assert not isinstance(e.value, TypeError) and needle in str(e.value), str(e.value)
    assert sched.step_count == 0 and (sync._sum, sync._count) == (0.0, 0)
    sched.step(loss=torch.tensor(0.25))
    sched.step(0.5)
    assert sched.step_count == 2 and sync.take() == (0.75, 2)


# ---- hdet/converge_s measures the converge -------------------------------------------------

class _AsyncConvergeSync(LocalSync):
    """A sync whose converge only *queues* its work, as CUDA kernels and NCCL calls do: a
    thread runs it (WORK_S of sleep) and ``synchronize()`` waits for it."""

    WORK_S = 0.3

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._pending: list[threading.Thread] = []

    def converge(self, finite):
        super().converge(finite)
        t = threading.Thread(target=time.sleep, args=(self.WORK_S,))
        t.start()
        self._pending.append(t)

    def synchronize(self):
        while self._pending:
            self._pending.pop().join()


def test_converge_time_includes_the_queued_work():
    """The clock waits for the device, not only for converge to return (~0 s): at least
    the queued WORK_S. Lower bound only (sleep may overrun)."""
    cfg = HDETConfig.from_dict({"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": 0.1}},
                                "schedule": {"name": "constant", "total_steps": 4}})
    sync = _AsyncConvergeSync(2)
    sched = HDETScheduler(cfg, {r: [{"lr": 0.1}] for r in range(2)}, sync)
    sched.step([1.0, 1.0])
    sched.step([1.0, 1.0])
    assert sched.last_sync["hdet/converge_s"] >= _AsyncConvergeSync.WORK_S


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (asynchronous kernels)")
def test_converge_time_waits_for_cuda():
    """On CUDA without a ``synchronize()`` of its own, the scheduler synchronizes the
    sync's ``backend.device``: converge_s covers the matmuls converge queued, measured
    independently with torch.cuda.synchronize (>= half of it: the GPU may warm up)."""
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)

    def work():
        for _ in range(20):
            a @ a

    work()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    work()
    torch.cuda.synchronize()
    reference = time.perf_counter() - t0

    class Backend:
        device = dev

    class CudaSync(LocalSync):
        backend = Backend()

        def converge(self, finite):
            super().converge(finite)
            work()

    cfg = HDETConfig.from_dict({"replicas": 2, "sync_interval": 1, "schedule": {"name": "constant",
                                                                                 "total_steps": 2}})
    sched = HDETScheduler(cfg, {r: [{"lr": 0.1}] for r in range(2)}, CudaSync(2))
    sched.step([1.0, 1.0])
    assert sched.last_sync["hdet/converge_s"] >= 0.5 * reference


# ---- W&B: the user's own run ----------------------------------------------------------------

def test_wandb_logger_logs_into_the_users_run_and_leaves_it_open(tmp_path, monkeypatch):
    """``reinit="finish_previous"`` would finish the user's run, and their next ``log``
    would raise: the records go into their run (its summary holds them, with hdet/step),
    the config is added without overwriting theirs, and it is still open after close."""
    wandb = pytest.importorskip("wandb")
    from hdet_scale.logging import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="mine", config={"lr": 1.0})
    try:
        logger = MetricsLogger(wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path)),
                               config={"hdet": {"replicas": 2}, "lr": 5.0})
        logger.log({"hdet/loss": 1.5, "train/tokens_per_s": 3.0}, step=7)
        logger.close()
        assert wandb.run is run and not run._is_finished
        assert run.config["lr"] == 1.0 and run.config["hdet"] == {"replicas": 2}
        assert (run.summary["hdet/loss"], run.summary["hdet/step"]) == (1.5, 7)
        run.log({"mine": 1.0})  # no UsageError ("Run ... is finished")
    finally:
        run.finish()
    own = MetricsLogger(wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path)))
    own_run = own._wandb_run
    own.log({"hdet/loss": 2.0}, step=1)
    own.close()
    assert own_run._is_finished  # a run the logger opened is its to finish


def test_wandb_without_a_usable_temporary_folder_is_one_line(tmp_path):
    """``hdet-train`` (W&B on by default) under ``ulimit -f 0`` fails in W&B's import,
    which makes a temporary folder (tempfile's "No usable temporary directory found"):
    one line, exit 2, before any rank starts, not a 30-line traceback and exit 1: the
    folders tempfile tried, the limit, and the ways out. The limit is real (the child's
    RLIMIT_FSIZE), so tempfile fails as it does for a user."""
    import resource
    import subprocess
    import sys

    pytest.importorskip("wandb")

    def no_file_bytes():  # ulimit -f 0 in the child only
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = subprocess.run([sys.executable, "-m", "hdet_scale.train.cli", f"run_dir={tmp_path / 'run'}",
                          "train.steps=50", "wandb.mode=offline"], preexec_fn=no_file_bytes,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_SILENT": "true"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = next(x for x in out.stderr.splitlines() if x.startswith("hdet-train: error:"))
    assert line.startswith("hdet-train: error: wandb.enabled=true, but W&B could not be imported: no temporary "
                           "folder is writable (No usable temporary directory found in ["), line
    assert line.endswith("; the file size limit, ulimit -f, is 0 bytes); set TMPDIR to a writable folder with free "
                         "space, raise ulimit -f, or set wandb.enabled=false"), line


def test_any_failure_of_the_wandb_import_is_one_line(monkeypatch):
    """Any exception of ``import wandb`` in the check before the ranks start (here a
    loader that raises, as a broken install would) is one HDETConfigError naming it."""
    import importlib.abc
    import importlib.util
    import sys

    from hdet_scale.logging import check_wandb_settings

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name == "wandb" else None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise RuntimeError("broken\n install")

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(HDETConfigError) as err:
        check_wandb_settings(WandbConfig(enabled=True, project="p"), prefix="hdet.logging.wandb.")
    assert str(err.value) == ("hdet.logging.wandb.enabled=true, but W&B could not be imported (RuntimeError: broken "
                              "install): repair the wandb install (pip install --force-reinstall wandb) or set "
                              "hdet.logging.wandb.enabled=false")


# ---- one replica ---------------------------------------------------------------------------

@pytest.mark.parametrize("block,warns", [
    ({"replicas": 1, "axes": {"lr": {"spread_ratio": 0.1}}}, "axes.lr.spread_ratio=0.1"),
    ({"replicas": 1, "auto": {"enabled": True}}, "auto.enabled=true"),
    ({"replicas": 1}, None),                                       # a deliberate baseline
    ({"replicas": 2, "axes": {"lr": {"spread_ratio": 0.1}}}, None),
])
def test_one_replica_with_a_spread_or_auto_lr_warns(block, warns):
    cfg = HDETConfig.from_dict({**block, "sync_interval": 5, "schedule": {"name": "constant", "total_steps": 10}})
    from hdet_scale.dryrun import describe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_config(cfg)
        # the optimizer block: hdet-train (and so the dry run) refuses ddp without one
        report = describe({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "hdet": cfg.to_dict()},
                          world_size=2, backend="ddp")
    msgs = [str(w.message) for w in caught if "hdet.replicas: 1 replica" in str(w.message)]
    if warns is None:
        assert msgs == [] and "warning: hdet.replicas" not in report
    else:
        assert len(msgs) == 1 and warns in msgs[0] and "HDET does nothing" in msgs[0]  # the dry run does not repeat it
        assert f"warning: hdet.replicas: 1 replica with {warns}" in report


# ---- auto-LR with nothing to compare; wrong types; what hdet-train refuses or notes ------------

_AUTO_ON = {"replicas": 2, "auto": {"enabled": True, "fitness": "train_loss"}}


@pytest.mark.parametrize("block,warns", [
    ({**_AUTO_ON, "axes": {"lr": {"spread_ratio": 0.0}}}, "(axes.lr.spread_ratio=0)"),
    ({**_AUTO_ON, "axes": {}}, "(axes.lr.spread_ratio=0)"),
    # a spread on an axis auto-LR does not control
    ({**_AUTO_ON, "axes": {"weight_decay": {"spread_ratio": 0.05, "kind": "additive"}}}, "(axes.lr.spread_ratio=0)"),
    ({"replicas": 2, "axes": {"lr": {"spread_ratio": 0.0}}}, None),  # auto off: the documented plain DP
    ({**_AUTO_ON, "axes": {"lr": {"spread_ratio": 0.1}}}, None),
    ({**_AUTO_ON, "replicas": 1}, None),  # single_replica_warning says it
])
def test_auto_lr_with_nothing_to_compare_warns(block, warns):
    """Auto-LR on, but no axis it controls has a spread: the hypergradient is 0 and the
    multiplier 1 for the whole run. hdet-train must not run so without a word (the
    Controller's warning is met only in the ranks, which leave config warnings to the
    launcher), nor hdet-dryrun promise a multiplier reaching x2.72."""
    cfg = HDETConfig.from_dict({**block, "sync_interval": 5, "schedule": {"name": "constant", "total_steps": 100}})
    from hdet_scale.dryrun import describe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_config(cfg)
    msgs = [str(w.message) for w in caught if str(w.message).startswith("hdet.auto.enabled: auto-LR is on")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dry run prints it as a line of its report, not also as a warning
        report = describe({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
                           "hdet": cfg.to_dict()}, world_size=2, backend="ddp") if cfg.replicas > 1 else ""
    if warns is None:
        assert msgs == [] and "warning: hdet.auto.enabled" not in report
        if cfg.replicas > 1 and cfg.auto.enabled:
            assert "meta-updates (first at step 5)" in report and "cannot move" not in report
        return
    assert len(msgs) == 1 and warns in msgs[0], msgs
    for needle in ("cannot move anything", "hdet.auto.enabled=false", "spread_ratio > 0"):
        assert needle in msgs[0]
    assert f"warning: {msgs[0]}" in report
    assert "auto-LR: on (controller log), but it cannot move anything in this run" in report
    assert "meta-updates" not in report and "the multiplier can reach" not in report


def test_the_controller_and_check_config_give_the_warning_once():
    """The library meets it twice (``check_config`` at initialize, then the Controller):
    shown once under Python's default filter."""
    cfg = HDETConfig.from_dict({**_AUTO_ON, "sync_interval": 5, "schedule": {"name": "constant", "total_steps": 100}})
    import subprocess
    import sys

    code = ("from hdet_scale.config import HDETConfig; from hdet_scale.autolr import Controller, build_schedule, "
            f"check_config; c = HDETConfig.from_dict({cfg.to_dict()!r}); check_config(c); "
            "Controller(c, build_schedule(c), [1e-3], [('lr', 0)])")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    assert err.count("hdet.auto.enabled:") == 1 and "cannot move anything" in err, err


def test_a_warm_up_past_the_run_names_a_sync_interval_past_it_too():
    """train.steps=20 with sync_interval=50 names both refusals at once, the warm-up's (25,
    derived) and the sync_interval's, rather than "lower it" for the warm-up, then the
    sync_interval's once lowered; following the advice (both lowered) is accepted."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    base = ["train.steps=20", "wandb.enabled=false", "backend=ddp"]
    run = load_run_config(None, [*base, "deepspeed.hdet.sync_interval=50", "deepspeed.hdet.auto.warmup_steps=25"])
    with pytest.raises(HDETConfigError) as e:
        validate(run, 4, build_model=False)
    assert str(e.value).splitlines()[1:] == [
        "  deepspeed.hdet.auto.warmup_steps: must be shorter than the run (schedule.total_steps=20), got 25; lower it "
        "and deepspeed.hdet.sync_interval (50: no sync in the run either), or set deepspeed.hdet.auto.enabled=false"
    ], str(e.value)
    validate(load_run_config(None, [*base, "deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.warmup_steps=5"]),
             4, build_model=False)
    run = load_run_config(None, [*base, "deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.warmup_steps=25"])
    with pytest.raises(HDETConfigError, match="got 25; lower it or set deepspeed.hdet.auto.enabled=false"):
        validate(run, 4, build_model=False)  # a sync_interval within the run: as before


@pytest.mark.parametrize("overrides,line", [
    # not also "auto.warmup_steps: leaves no sync after warm-up ... (sync_interval 1000)", the default
    # standing in for the refused value
    (["deepspeed.hdet.sync_interval=5.0"], "deepspeed.hdet.sync_interval: expected int, got 5.0"),
    # the default controller 'log' standing in: "decay is a setting of controller 'paper'"
    (["deepspeed.hdet.auto.controller=5", "deepspeed.hdet.auto.decay=0.5"],
     "deepspeed.hdet.auto.controller: expected str, got 5"),
])
def test_a_wrong_type_draws_no_verdict_computed_from_its_default(overrides, line):
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run = load_run_config(None, [*overrides, "train.steps=100", "wandb.enabled=false"])
    with pytest.raises(HDETConfigError) as e:
        validate(run, 4, build_model=False)
    assert str(e.value).splitlines()[1:] == [f"  {line}"], str(e.value)


def test_hdet_dryrun_gives_a_wrong_type_one_line(tmp_path):
    from hdet_scale.dryrun import describe

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "hdet": {"replicas": 2, "sync_interval": 5.0, "auto": {"enabled": True}, "schedule": {"total_steps": 100}}}
    with pytest.raises(HDETConfigError) as e:
        describe(config, world_size=2, backend="ddp")
    assert str(e.value).splitlines()[1:] == ["  hdet.sync_interval: expected int, got 5.0"], str(e.value)


def test_max_seq_len_below_one_is_named_not_data_seq_len():
    """Was ``data.seq_len: must be in [1, model.max_seq_len=0], got 128``."""
    assert _run_config_error(overrides=["model.max_seq_len=0"]) == "model.max_seq_len must be an integer >= 1; got 0"


@pytest.mark.parametrize("override,line", [
    ("deepspeed.hdet.axes.lr.groups=[5]",
     "deepspeed.hdet.axes.lr.groups: group 5 does not exist (the optimizer has 1 parameter groups)"),
    ("deepspeed.hdet.schedule.max_lr=[1e-3,1e-3,1e-3]", "deepspeed.hdet.schedule.max_lr: 3 values for 1 parameter "
                                                         "groups"),
])
def test_hdet_train_refuses_groups_its_optimizer_does_not_have(override, line):
    """hdet-train builds one parameter group: these were refused by the library in every
    rank, after W&B started (18-39 s); now by validate, before anything starts, in the
    library's words (param_groups.check_group_count)."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    for backend in ("deepspeed", "ddp"):
        run = load_run_config(None, [override, f"backend={backend}", "wandb.enabled=false"])
        with pytest.raises(HDETConfigError) as e:
            validate(run, 4, build_model=False)
        assert str(e.value) == line


def test_a_schedule_longer_than_the_run_gets_a_note(tmp_path):
    from hdet_scale.train.run_notes import never_notes as _never_notes
    from hdet_scale.train.config import load_run_config

    run = load_run_config(None, ["train.steps=50", "deepspeed.hdet.schedule.total_steps=300"])
    notes = [n for n in _never_notes(run) if n.startswith("deepspeed.hdet.schedule.total_steps")]
    assert notes == ["deepspeed.hdet.schedule.total_steps=300 > train.steps=50: the run covers the schedule's first "
                     "50 steps only and ends before its LR anneals (leave total_steps out, or set it to train.steps, "
                     "to run the whole schedule)"]
    for same in (["train.steps=50"], ["train.steps=50", "deepspeed.hdet.schedule.total_steps=50"]):
        assert not any("total_steps" in n for n in _never_notes(load_run_config(None, same)))


def test_a_deepspeed_json_without_an_hdet_block_is_refused_and_a_block_that_searches_nothing_noted(tmp_path):
    """A user's DeepSpeed JSON without the hdet block, or with ``"hdet": {}``, would
    train plain data parallelism (1 replica group) without a word, on every backend:
    refused. ``{"replicas": 2}`` alone would train two replica groups with no spread and
    the default sync_interval 1000 past an 8-step run: a note for each, the
    sync_interval's also where the interval is the default, not set. The packaged config
    gets neither."""
    from hdet_scale.train.run_notes import never_notes as _never_notes
    from hdet_scale.train.config import load_run_config, packaged

    ds = json.loads(open(packaged("deepspeed.json")).read())
    for name, block, word in (("none.json", None, "no"), ("empty.json", {}, "an empty")):
        path = tmp_path / name
        path.write_text(json.dumps({k: v for k, v in ds.items() if k != "hdet"} | ({} if block is None
                                                                                    else {"hdet": block})))
        for backend in ("deepspeed", "ddp"):
            with pytest.raises(HDETConfigError, match=rf"^deepspeed.hdet: {path} has {word} hdet block, so the run "
                                                      r"would be plain data parallelism \(one replica\)"):
                load_run_config(None, [f"deepspeed_config={path}", f"backend={backend}"])
    (tmp_path / "r2.json").write_text(json.dumps({**ds, "hdet": {"replicas": 2}}))
    run = load_run_config(None, [f"deepspeed_config={tmp_path / 'r2.json'}", "train.steps=8"])
    notes = _never_notes(run)
    assert notes[0] == ("deepspeed.hdet.sync_interval=1000 (the default) > train.steps=8: no sync during the run (no "
                        "auto-LR step, the replicas are averaged only by the final converge)")
    assert notes[1].startswith("deepspeed.hdet: 2 replicas but no axis has a spread"), notes
    assert [n for n in _never_notes(load_run_config(None, ["train.steps=100"]))
            if n.startswith("deepspeed.hdet")] == []  # the packaged block: syncs and spreads


# ---- overrides and interpolations of the run config -----------------------------------------

@pytest.mark.parametrize("overrides,line", [
    # a raw yaml.parser.ParserError traceback
    (["train.steps=[1,"], "override 'train.steps=[1,': the value '[1,' of train.steps is not a valid YAML value "
                          "(did not find expected node content); quote it for a string, e.g. 'run_dir=\"a,b\"'"),
    # a raw ValueError from OmegaConf.update; "Cannot merge incompatible container types"; accepted
    (["train=[1,2]", "train.progress=false"], "train: must be a mapping of train.* keys, e.g. train.steps=100; "
                                              "got [1, 2]"),
    (["train.progress=false", "train=[1,2]"], "train: must be a mapping of train.* keys, e.g. train.steps=100; "
                                              "got [1, 2]"),
    (["model=5", "model.hidden_size=64"], "model: must be a mapping of model.* keys, e.g. model.hidden_size=256; "
                                          "got 5"),
    # the last value won silently
    (["train.steps=5", "train.steps=7"], "multiple values for train.steps: 'train.steps=5' and 'train.steps=7'; "
                                         "keep one"),
    (["deepspeed.hdet={replicas: 3}", "deepspeed.hdet.replicas=2"],
     "multiple values for deepspeed.hdet.replicas: 'deepspeed.hdet={replicas: 3}' and 'deepspeed.hdet.replicas=2'; "
     "keep one"),
    (["deepspeed.hdet.replicas=2", "deepspeed.hdet=5"],
     "'deepspeed.hdet=5' sets deepspeed.hdet to a single value and 'deepspeed.hdet.replicas=2' sets a key inside "
     "it: keep one"),
])
def test_each_override_error_names_the_override(overrides, line):
    assert _run_config_error(overrides=overrides) == line


def test_overrides_that_do_not_collide_still_merge_and_override_the_yaml(tmp_path):
    """The checks above refuse only what collides: a mapping and a key it does not set
    merge, and an override still replaces the run YAML's value. Compared with the same
    settings given as separate keys (the plain-dict results must be equal)."""
    from hdet_scale.train.config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 20\n")
    merged = load_run_config(str(path), ["deepspeed.hdet={replicas: 4}", "deepspeed.hdet.sync_interval=5",
                                         "train.steps=30", "wandb.enabled=false"])
    separate = load_run_config(None, ["deepspeed.hdet.replicas=4", "deepspeed.hdet.sync_interval=5",
                                      "train.steps=30", "wandb.enabled=false"])
    assert merged == separate
    assert (merged["train"]["steps"], merged["deepspeed"]["hdet"]["replicas"],
            merged["deepspeed"]["hdet"]["sync_interval"]) == (30, 4, 5)


@pytest.mark.parametrize("where,key,text,cause", [
    ("override", "train.steps", "${oops}", "Interpolation key 'oops' not found"),
    ("override", "run_dir", "${oc.env:HDET_TEST_NOPE_NOT_SET}", "Environment variable 'HDET_TEST_NOPE_NOT_SET' not found"),
    ("override", "run_dir", "${foo:bar}", "Unsupported interpolation type foo"),
    ("override", "train.steps", "${run_dir}", "could not be converted to Integer"),
    ("override", "deepspeed.hdet.replicas", "${oops}", "Interpolation key 'oops' not found"),
    ("yaml", "train.steps", "${oops}", "Interpolation key 'oops' not found"),
])
def test_an_interpolation_that_cannot_be_resolved_names_key_and_interpolation(tmp_path, monkeypatch, where, key,
                                                                              text, cause):
    """Raw OmegaConf tracebacks (InterpolationKeyError...) before: interpolations are
    now resolved when the config is read. The same interpolation resolves when what it
    names exists (the environment variable set), to the value a literal gives."""
    from hdet_scale.train.config import load_run_config

    monkeypatch.delenv("HDET_TEST_NOPE_NOT_SET", raising=False)
    if where == "yaml":
        path = tmp_path / "run.yaml"
        section, leaf = key.split(".")
        path.write_text(f"{section}:\n  {leaf}: {text}\n")
        msg, source = _run_config_error(path), f"config file {str(path)!r}"
    else:
        msg, source = _run_config_error(overrides=[f"{key}={text}"]), f"override '{key}={text}'"
    assert msg.startswith(f"{key}: the interpolation {text!r} ({source}) cannot be resolved: "), msg
    assert cause in msg and "\n" not in msg, msg
    monkeypatch.setenv("HDET_TEST_NOPE_NOT_SET", str(tmp_path / "r"))
    resolved = load_run_config(None, ["run_dir=${oc.env:HDET_TEST_NOPE_NOT_SET}/x", "wandb.enabled=false"])
    literal = load_run_config(None, [f"run_dir={tmp_path / 'r'}/x", "wandb.enabled=false"])
    assert resolved == literal


def test_round_20_messages(tmp_path):
    """Each is named, with advice that leads somewhere: a dotted key in the run YAML (not
    "unknown key"), a key that is not a name (not OmegaConf's "Incompatible key type",
    and with the file), an additive spread of a decay of 0 (the one fix, not two dead
    ends), auto-LR with a spread lr axis at auto false (set its auto: true, not add the
    spread it has), an axis' auto: true with auto-LR off (a warning, not silent),
    --precision bf16 on ddp (no advice of a bf16 the engine refuses)."""
    from hdet_scale.autolr import check_additive_floors
    from hdet_scale.cost import check_options
    from hdet_scale.cost_report import dryrun_section

    dotted, keys = tmp_path / "dot.yaml", tmp_path / "keys.yaml"
    dotted.write_text("train.steps: 5\n")
    keys.write_text("1: 2\n")
    assert "train.steps: a dotted key is not nested in YAML; write train: {steps: ...}" in _run_config_error(dotted)
    assert "the key 1 (int) is not a name" in _run_config_error(keys) and "keys.yaml" in _run_config_error(keys)
    wd = HDETConfig.from_dict({"replicas": 2, "axes": {"weight_decay": {"spread_ratio": 0.1, "kind": "additive"}},
                               "schedule": {"total_steps": 100}})
    with pytest.raises(HDETConfigError, match=r"weight_decay must stay >= 0: set weight_decay >= 0.1 in the "
                                              r"optimizer \(optimizer.params\)$"):
        check_additive_floors(wd, build_schedule(wd), {("weight_decay", 0): 0.0})
    frozen = HDETConfig.from_dict({"replicas": 2, "sync_interval": 5,
                                   "axes": {"lr": {"spread_ratio": 0.2, "auto": False}},
                                   "schedule": {"total_steps": 100}, "auto": {"enabled": True, "warmup_steps": 10}})
    text = frozen.auto_without_spread_warning
    assert "to let it move one, set auto: true on a spread axis (e.g. hdet.axes.lr.auto=true)" in text, text
    off = HDETConfig.from_dict({"replicas": 2, "axes": {"temperature": {"spread_ratio": 0.1, "auto": True}},
                                "schedule": {"total_steps": 100}, "auto": {"enabled": False}})
    assert off.auto_off_warning.startswith("hdet.axes.temperature.auto: true has no effect while hdet.auto.enabled")
    with pytest.warns(UserWarning, match="true has no effect while hdet.auto.enabled is false"):
        check_config(off)
    options = check_options(params="7B", precision="bf16")
    with pytest.raises(HDETConfigError, match="--precision bf16: the ddp backend trains in float32"):
        dryrun_section(off, {}, "ddp", 4, options)


def test_schedule_keys_another_schedule_reads_are_named(capsys):
    """A schedule key set to a value other than its default that the chosen schedule does
    not read is a warning (check_config, so the library and hdet-train; a line of the dry
    run): ``schedule.name=cosine`` over the packaged OneCycle block would otherwise train
    without its ``pct_start`` warm-up and ``hdet-dryrun`` say nothing of the dropped
    keys. Defaults, as every ``to_dict()`` round trip lists them, are not."""
    from hdet_scale.dryrun import describe

    ds = packaged(ADAMW)
    ds["hdet"]["schedule"]["name"] = "cosine"
    cfg = HDETConfig.from_dict(ds["hdet"])
    want = ("hdet.schedule: schedule.name 'cosine' does not read final_div_factor=10.0 (onecycle), pct_start=0.2 "
            "(onecycle); it reads min_ratio=0.1, warmup_steps=0")
    assert cfg.schedule_unused_warning.startswith(want), cfg.schedule_unused_warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_config(cfg)
    assert [str(w.message) for w in caught if "does not read" in str(w.message)] == [cfg.schedule_unused_warning]
    assert f"warning: {want}" in describe(ds, world_size=4)
    ds["hdet"]["schedule"] = {"name": "onecycle", "total_steps": 100, "warmup_steps": 5, "base_momentum": 0.9}
    msg = HDETConfig.from_dict(ds["hdet"]).schedule_unused_warning
    assert "base_momentum=0.9 (onecycle with cycle_momentum true)" in msg and "warmup_steps=5 (cosine, constant)" in msg
    for name in ("onecycle", "cosine", "constant"):  # a round trip of the defaults: nothing to say
        assert HDETConfig.from_dict(HDETConfig.from_dict(
            {"schedule": {"name": name, "total_steps": 100}}).to_dict()).schedule_unused_warning is None


@pytest.mark.parametrize("path,overrides,want", [
    ("--steps", ["10"], "did you mean train.steps=10?"),        # was "did you mean --steps=10?", refused in turn
    (None, ["--steps=10"], "did you mean train.steps=10?"),     # was "--steps: unknown key"
    (None, ["train.steps=5", "--run-dir=x"], "did you mean run_dir=x?"),
    (None, ["--enabled=false"], "did you mean wandb.enabled=false?"),
    (None, ["--nothing=1"], "(e.g. train.steps=10)"),
])
def test_a_dashed_option_names_the_override_of_that_name(path, overrides, want):
    """An option-like argument (``hdet-train --steps 10``) is named with the key=value
    override of that name (a trainer key whose last part it is), not ``--steps=10``,
    which would then fail as an unknown key."""
    msg = _run_config_error(path, overrides)
    assert "hdet-train takes no --options" in msg and msg.endswith(want), msg


def test_version_of_each_command(capsys):
    from hdet_scale import __version__
    from hdet_scale.train import cli

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"hdet-train (hdet_scale) {__version__}\n"


def test_help_with_anything_after_it_is_refused(capsys):
    """``hdet-train --help extra`` does not print the help and drop ``extra`` without a
    word. Alone it still prints the help (exit 0)."""
    from hdet_scale.train import cli

    for flag in ("--help", "-h"):
        assert cli.main([flag, "extra", "train.steps=3"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"hdet-train: error: {flag} takes nothing after it ('extra' 'train.steps=3' "
                                     f"given); run hdet-train {flag} alone, or drop it to train\n"), err
        assert cli.main([flag]) == 0
        assert "hdet-train" in capsys.readouterr().out


def test_a_tilde_in_a_path_key_is_the_home_folder(tmp_path, monkeypatch):
    """Every path key expands ``~`` as a shell would, as ``data.path`` does: ``run_dir:
    ~/x`` in a YAML is no ``./~/x`` (the plots line naming the home folder),
    ``deepspeed_config: ~/ds.json`` no "does not exist"."""
    from hdet_scale.train.config import load_run_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ds.json").write_text(json.dumps(packaged()))
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("run_dir: ~/runs/a\ndeepspeed_config: ~/ds.json\nwandb: {dir: ~/wb}\n")
    run = load_run_config(str(yaml_file), ["train.steps=100"])
    assert run["run_dir"] == str(tmp_path / "runs" / "a")
    assert run["deepspeed_config"] == str(tmp_path / "ds.json")
    assert run["wandb"]["dir"] == str(tmp_path / "wb")
    assert run["deepspeed"]["hdet"]["schedule"]["total_steps"] == 100  # the file's, read from the home folder


def test_hf_trainer_run_length_is_held_to_the_schedule():
    """HDETTrainer with ``hdet.schedule.total_steps=4`` and ``max_steps=6`` would train 4
    steps, then both ranks die in the scheduler ("Tried to step 5 times"); with 100
    against 6 the LR would never leave the warm-up, without a word. hdet-train holds
    total_steps to train.steps; ``HDETTrainer._check`` calls this at construction
    (max_steps set) or when train() starts (epochs)."""
    from hdet_scale.hf_config import check_run_length

    block = {"schedule": {"name": "onecycle", "total_steps": 4}}
    with pytest.raises(HDETConfigError, match=r"total_steps: 4 is shorter than the Trainer's 6 optimizer steps"):
        check_run_length(block, 6)
    with pytest.warns(UserWarning, match=r"total_steps=100 > the Trainer's 6 optimizer steps"):
        check_run_length({"schedule": {"total_steps": 100}}, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ok_block, steps in ((block, 4), ({"schedule": {"total_steps": "auto"}}, 6), (block, None), (None, 6)):
            check_run_length(ok_block, steps)


@pytest.mark.parametrize("text,what", [("", "empty, or comments only"), ("# steps: 10\n\n", "empty, or comments only"),
                                       ("{}\n", "an empty mapping")])
def test_a_config_file_that_sets_nothing_is_noted(tmp_path, capsys, text, what):
    """An empty or comments-only CONFIG.yaml (a truncated copy, the wrong file) does not
    train the packaged defaults without a word: one note, before any rank starts; none
    for a file that sets a key."""
    from hdet_scale.train.start_notes import print_engine_notes as _print_engine_notes
    from hdet_scale.train.config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text(text)
    run = load_run_config(str(path), ["backend=ddp", "wandb.enabled=false"])
    _print_engine_notes(run, str(path))
    notes = [line for line in capsys.readouterr().err.splitlines() if "sets nothing" in line]
    assert notes == [f"hdet-train: note: config file {str(path)!r} sets nothing ({what}): the run uses the packaged "
                     "defaults and the key=value overrides"]
    path.write_text("train:\n  steps: 50\n")
    _print_engine_notes(load_run_config(str(path), ["backend=ddp", "wandb.enabled=false"]), str(path))
    assert "sets nothing" not in capsys.readouterr().err


@pytest.mark.parametrize("yaml_value,override,message", [
    ("1e1", None, "train.steps: expected an integer, got 10.0 (a float, config file {path!r})"),
    (None, "1e1", "train.steps: expected an integer, got 10.0 (a float, override 'train.steps=1e1')"),
    ("abc", None, "train.steps: expected an integer, got abc (a string, config file {path!r})"),
    ("1e1", "abc", "train.steps: expected an integer, got 10.0 (a float, config file {path!r})"),  # the file's, first
    ("5", "abc", "train.steps: expected an integer, got abc (a string, override 'train.steps=abc')"),
])
def test_a_value_of_the_wrong_type_names_where_it_was_written(tmp_path, yaml_value, override, message):
    """``steps: 1e1`` in a YAML says what is expected and where the value came from: the
    config file or the override (the input whose merge failed, when both set the key),
    not OmegaConf's "Value '10.0' of type 'float' could not be converted to Integer",
    naming no file."""
    path = tmp_path / "run.yaml"
    if yaml_value is not None:
        path.write_text(f"train:\n  steps: {yaml_value}\n")
    msg = _run_config_error(path if yaml_value is not None else None,
                            overrides=[f"train.steps={override}"] if override else [])
    assert msg == message.format(path=str(path)), msg


def test_hdettrainer_names_the_trainer_scheduler_settings_it_does_not_use(tmp_path):
    """``lr_scheduler_type="cosine"`` and ``warmup_steps=3`` are ignored at run time
    (docs/hf_trainer.md says so): HDETTrainer warns at construction. Real
    ``TrainingArguments``; the defaults say nothing."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from hdet_scale.hf_config import ignored_scheduler_args

    def text(**kw):
        return ignored_scheduler_args(TrainingArguments(output_dir=str(tmp_path), report_to=[], **kw))

    assert text() is None
    got = text(lr_scheduler_type="cosine", warmup_steps=3)
    assert got == ("TrainingArguments lr_scheduler_type='cosine', warmup_steps=3: not used with an hdet block; the LR "
                   "follows hdet.schedule (name, pct_start or warmup_steps, total_steps: docs/config.md)"), got
    assert "lr_scheduler_kwargs={'num_cycles': 2}" in text(lr_scheduler_type="cosine_with_restarts",
                                                          lr_scheduler_kwargs={"num_cycles": 2})
    assert text(lr_scheduler_type="linear", warmup_steps=0) is None


@pytest.mark.parametrize("project", ["a/b", "a#b", "x" * 129])
def test_a_wandb_project_name_wandb_refuses_is_refused_before_any_rank_starts(project):
    """``wandb.project=a/b`` (or ``hdet.logging.wandb.project`` in the library's block)
    is checked with W&B's own Settings validator, in the checks every rank runs before
    any collective, not at rank 0's ``wandb.init`` after the ranks started, with a
    message to check the network of an offline run; a name it takes passes."""
    pytest.importorskip("wandb")
    from hdet_scale.backends.common import resolve_config
    from hdet_scale.config import WandbConfig
    from hdet_scale.logging import check_wandb_settings

    with pytest.raises(HDETConfigError, match=r"^wandb.project: Invalid project name"):
        check_wandb_settings(WandbConfig(enabled=True, mode="offline", project=project))
    block = {"schedule": {"total_steps": 10}, "logging": {"wandb": {"enabled": True, "mode": "offline",
                                                                    "project": project}}}
    with pytest.raises(HDETConfigError, match=r"^hdet.logging.wandb.project: Invalid project name"):
        resolve_config(block, world=2)
    check_wandb_settings(WandbConfig(enabled=True, mode="offline", project="my-project_1.2"))
    check_wandb_settings(WandbConfig(enabled=False, project=project))  # W&B off: its settings are not read


def test_a_config_file_after_the_overrides_is_told_to_go_first(tmp_path):
    """``hdet-train train.steps=10 run.yaml`` says that the YAML goes first, not only
    "overrides must be key=value"."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 5\n")
    msg = _run_config_error(None, overrides=["train.steps=10", str(path)])
    assert msg.endswith(f"got [{str(path)!r}]; a config file goes first: hdet-train {path} key=value ..."), msg


@pytest.mark.parametrize("optimizer,line", [
    ({"params": {"lr": 1e-3}}, 'deepspeed.optimizer: has no "type"; DeepSpeed reads an optimizer block only through '
                               'its type and would ignore this one, params included: name the optimizer\'s class, '
                               'e.g. "type": "AdamW"'),
    ({"type": None, "params": {"lr": 1e-3}}, 'deepspeed.optimizer: has no "type"'),
    ({"type": 5, "params": {"lr": 1e-3}}, 'deepspeed.optimizer.type: expected the optimizer\'s class name as a '
                                          'string, e.g. "AdamW", got 5'),
])
def test_an_optimizer_block_without_a_type_names_the_type(ds_keys, optimizer, line):
    """An optimizer block without ``type``, and one with a numeric type, name the type,
    alone, and DeepSpeed indeed builds no optimizer from such a block. Not "optimizer.params:
    unknown DeepSpeed key; valid keys: legacy_fusion, type" (DeepSpeed reads the params only
    through the type, so its parser never asks for them), which sends the user to the params,
    nor DeepSpeed's parser stopping without naming a key."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = packaged()
    ds["optimizer"] = optimizer
    if optimizer.get("type") is None:  # DeepSpeed's own reading: no optimizer, params dropped
        plain = DeepSpeedConfig({**{k: v for k, v in ds.items() if k != "hdet"}, "train_batch_size": 8})
        assert plain.optimizer_name is None and plain.optimizer_params is None
    hdet_like, refused, unknown = ds_keys.find_problems(ds, prefix="deepspeed.")
    assert (hdet_like, unknown) == ([], []) and len(refused) == 1 and refused[0].startswith(line), refused
    with pytest.raises(HDETConfigError) as e:
        ds_keys.check_deepspeed_keys(ds, strict=True, prefix="deepspeed.")
    assert str(e.value).splitlines()[1:] == [f"  {refused[0]}"]


def test_a_mapping_override_that_keeps_keys_of_the_json_gets_a_note():
    """``'deepspeed.hdet.axes={weight_decay: {spread_ratio: 0.5}}'`` reads as "these axes
    only", but overrides merge, so the packaged lr spread stays: a note names what is kept
    (``axes={}`` is refused). A mapping that covers every key, a dotted override and a
    non-mapping value get none."""
    from hdet_scale.train.config import packaged
    from hdet_scale.train.config_files import load_deepspeed_json
    from hdet_scale.train.config_merge import kept_by_merge

    ds = load_deepspeed_json(packaged("deepspeed.json"))
    assert list(ds["hdet"]["axes"]) == ["lr"]
    notes = kept_by_merge(["deepspeed.hdet.axes={weight_decay: {spread_ratio: 0.5}}"], ds, "the packaged deepspeed.json")
    assert notes == ["override deepspeed.hdet.axes={...} merges into the packaged deepspeed.json: its lr is kept as "
                     "there (to change lr, set deepspeed.hdet.axes.lr.<key>=..., e.g. spread_ratio=0 to drop the axis)"]
    assert kept_by_merge(["deepspeed.hdet.axes={lr: {spread_ratio: 0.2}, weight_decay: {spread_ratio: 0.5}}",
                          "deepspeed.hdet.axes.weight_decay.spread_ratio=0.5", "deepspeed.hdet.replicas=2",
                          "train.steps={a: 1}"], ds, "x") == []


def test_round_30_a_deepspeed_section_list_and_an_hdet_block_of_overrides_only(tmp_path):
    """``deepspeed=[1,2]`` (or a YAML list there) and ``deepspeed=null`` are refused as no
    mapping (not OmegaConf's "Cannot merge incompatible container types" traceback, not a
    run of the defaults). A DeepSpeed JSON without a block plus
    ``deepspeed.hdet.sync_interval=2`` would run one replica group (plain data
    parallelism): refused, as the same JSON without overrides is, not a note naming the
    default replicas=1."""
    from hdet_scale.train.run_notes import never_notes as _never_notes
    from hdet_scale.train.config import load_run_config, packaged

    for value, shown in (("[1,2]", "[1, 2]"), ("[]", "[]"), ("null", "null"), ("5", "5")):
        with pytest.raises(HDETConfigError, match=r"^deepspeed: must be a mapping of deepspeed.\* keys, e\.g\. "
                                                  rf"deepspeed.train_micro_batch_size_per_gpu=4; got {re.escape(shown)}$"):
            load_run_config(None, [f"deepspeed={value}"])
    (tmp_path / "run.yaml").write_text("deepspeed: [1, 2]\n")
    with pytest.raises(HDETConfigError, match=r"run.yaml'?: deepspeed: must be a mapping"):
        load_run_config(str(tmp_path / "run.yaml"), [])
    ds = json.loads(open(packaged("deepspeed.json")).read())
    ds.pop("hdet")
    (tmp_path / "nohdet.json").write_text(json.dumps(ds))
    # refused, not a note (the same JSON alone is refused)
    with pytest.raises(HDETConfigError, match=r"^deepspeed.hdet.replicas: the hdet block \(.*nohdet.json and the "
                                              r"overrides\) sets no replicas, .* plain data parallelism; set "
                                              r"deepspeed.hdet.replicas=2 .* or deepspeed.hdet.replicas=1 for a plain "
                                              r"data-parallel baseline$"):
        load_run_config(None, [f"deepspeed_config={tmp_path / 'nohdet.json'}", "deepspeed.hdet.sync_interval=2",
                               "train.steps=20"])
    # the block spelled "hdett" (replicas and all) with overrides beside it: the typo is named
    # in the same line as "sets no replicas", not one fix later, as a second error
    hdett = {**ds, "hdett": json.loads(open(packaged("deepspeed.json")).read())["hdet"]}
    (tmp_path / "hdett.json").write_text(json.dumps(hdett))
    with pytest.raises(HDETConfigError, match=r"^deepspeed.hdet.replicas: the hdet block \(.*hdett.json and the "
                                              r"overrides\) sets no replicas \('hdett' is not read: did you mean "
                                              r"'hdet'\?\), "):
        load_run_config(None, [f"deepspeed_config={tmp_path / 'hdett.json'}", "deepspeed.hdet.sync_interval=2",
                               "train.steps=20"])
    (tmp_path / "nullhdet.json").write_text(json.dumps({**ds, "hdet": None}))
    with pytest.raises(HDETConfigError, match=r"^deepspeed.hdet.replicas: the hdet block"):
        load_run_config(None, [f"deepspeed_config={tmp_path / 'nullhdet.json'}", "deepspeed.hdet.sync_interval=2",
                               "train.steps=20"])
    run = load_run_config(None, [f"deepspeed_config={tmp_path / 'nohdet.json'}", "deepspeed.hdet.replicas=1",
                                 "deepspeed.hdet.sync_interval=2", "train.steps=20"])
    assert not any("replicas=1" in n for n in _never_notes(run))  # set on purpose: no note


def test_a_probe_costing_more_than_the_training_between_syncs_gets_a_note():
    """``train.probe_batches=100000`` is not accepted without a word (every sync would then
    look like a hang). The note starts where the probe's forward passes (about a third of a
    trained micro-batch each) cost more than the sync interval's training: packaged
    sync_interval 25, accumulation 1 -> more than 75."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.run_notes import never_notes

    def probe_notes(*overrides):
        run = load_run_config(None, ["train.steps=100", *overrides])
        return [n for n in never_notes(run) if n.startswith("train.probe_batches")]

    note = probe_notes("train.probe_batches=100000")
    assert len(note) == 1 and "runs 100000 forward micro-batches per rank" in note[0] and "the 25 micro-batches" in note[0]
    assert probe_notes("train.probe_batches=75") == []
    assert len(probe_notes("train.probe_batches=76")) == 1
    assert probe_notes("train.probe_batches=76", "deepspeed.gradient_accumulation_steps=4") == []  # 100 trained
    assert probe_notes("train.probe_batches=100000", "deepspeed.hdet.auto.enabled=false") == [  # no probe runs
        "train.probe_batches=100000 has no effect: auto-LR does not run (the probe is read only with auto.fitness=probe)"]
    assert probe_notes("train.probe_batches=100000", "deepspeed.hdet.sync_interval=200") == []  # no sync in the run


def test_a_data_path_named_twice_gets_a_note(tmp_path):
    """``data.path=a,a`` (the file read once) gets a note."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.run_notes import never_notes

    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    (tmp_path / "b.txt").write_text("other text\n" * 100)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"

    def data_notes(path):
        return [n for n in never_notes(load_run_config(None, [f"data.path={path}"])) if n.startswith("data.path")]

    assert data_notes(f"{a},{b},{a}") == [f"data.path names {str(a)!r} twice: the corpus holds each file once, at its "
                                          "first place, and the run is the same as without the repeat (to weight a "
                                          "file, give a copy of it)"]
    assert len(data_notes(f"{tmp_path},{tmp_path}/")) == 1  # the same folder, spelled two ways
    # a file of a folder named before it
    assert data_notes(f"{tmp_path},{a}") == [f"data.path names {str(a)!r} after {str(tmp_path)!r}, which holds it: the "
                                             "corpus holds each file once, at its first place, and the run is the "
                                             "same as without the repeat (to weight a file, give a copy of it)"]
    assert data_notes(f"{a},{b}") == [] and data_notes(f"{a},{tmp_path}") == []  # the folder adds b.txt


def test_null_over_a_key_of_the_deepspeed_json_says_how_to_leave_it_out():
    """``deepspeed.gradient_clipping=null`` (meant as "leave it out") says that an
    override cannot remove a key, not "must be a number >= 0, got None"."""
    from hdet_scale.train.config import load_run_config

    with pytest.raises(HDETConfigError) as e:
        load_run_config(None, ["deepspeed.gradient_clipping=null"])
    assert "deepspeed.gradient_clipping: must be a number >= 0 (0: off), got None" in str(e.value)
    assert ("deepspeed.gradient_clipping=null sets null, it does not remove gradient_clipping from "
            in str(e.value)) and "give your own deepspeed_config file without it" in str(e.value)
    with pytest.raises(HDETConfigError) as e:  # a value that is not null: no hint
        load_run_config(None, ["deepspeed.gradient_clipping=-1"])
    assert "sets null" not in str(e.value)


def test_two_config_files_are_named_as_two(tmp_path):
    """``hdet-train empty.yaml list.yaml`` does not say "a config file goes first:
    hdet-train list.yaml key=value" where a config file is first already."""
    from hdet_scale.train.config import load_run_config

    (tmp_path / "a.yaml").write_text("train: {steps: 10}\n")
    (tmp_path / "b.yaml").write_text("train: {steps: 20}\n")
    with pytest.raises(HDETConfigError) as e:
        load_run_config(str(tmp_path / "a.yaml"), [str(tmp_path / "b.yaml"), "train.plots=false"])
    assert str(e.value) == (f"two config files, {str(tmp_path / 'a.yaml')!r} and {str(tmp_path / 'b.yaml')!r}: "
                            "hdet-train reads one (hdet-train CONFIG.yaml key=value ...); merge them, or give the "
                            "second's settings as key=value")
    with pytest.raises(HDETConfigError, match="a config file goes first: hdet-train b.yaml"):  # no file first: as before
        load_run_config(None, ["train.steps=5", "b.yaml"])


def test_values_read_otherwise_than_given_get_a_note(tmp_path, monkeypatch):
    """Each of these would be accepted without a word and gets a note:
    optimizer.params.lr beside hdet.schedule.max_lr (the run peaks at max_lr);
    train.eval_batches=19 on 4 ranks (evaluates 16: its val_loss equal to
    eval_batches=16's); train.probe_batches with auto.fitness=train_loss (no probe
    runs); train.resume=true on a run_dir holding no run (a new run from step 0). Each
    set as intended (or left at its default) gets none."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.run_notes import never_notes

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def notes(*overrides):
        return never_notes(load_run_config(None, ["train.steps=100", f"run_dir={tmp_path / 'run'}", *overrides]))

    assert notes() == []
    got = notes("deepspeed.hdet.schedule.max_lr=0.01", "deepspeed.optimizer.params.lr=0.001")
    assert got == ["deepspeed.optimizer.params.lr=0.001 has no effect on the LR: deepspeed.hdet.schedule.max_lr=0.01 "
                   "sets the peak of the schedule, which sets the LR of every step (change max_lr, or leave it out to "
                   "peak at optimizer.params.lr)"]
    assert notes("deepspeed.hdet.schedule.max_lr=0.0025") == []  # equal to the packaged lr: nothing lost
    assert notes("train.eval_batches=19") == ["train.eval_batches=19: the validation loss reads 16 micro-batches (4 on "
                                              "each of the 4 ranks: a multiple of the ranks)"]
    assert notes("train.eval_batches=2") == ["train.eval_batches=2: the validation loss reads 4 micro-batches (1 on "
                                             "each of the 4 ranks: a multiple of the ranks)"]
    assert notes("train.eval_batches=8") == [] and notes("train.eval_batches=6", "nproc=2") == []
    assert notes("train.probe_batches=50", "deepspeed.hdet.auto.fitness=train_loss") == [
        "train.probe_batches=50 has no effect: deepspeed.hdet.auto.fitness=train_loss (the probe is read only with "
        "auto.fitness=probe)"]
    assert notes("train.probe_batches=50") == []  # the probe reads them
    assert notes("train.resume=true") == [
        f"train.resume=true: {tmp_path / 'run'} holds no run to resume (no checkpoint), so this is a new run from "
        f"step 0 (a relative run_dir is read from the working directory {os.getcwd()})"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert notes("train.resume=true") == []  # a run there: resumed or refused (start_mode), no note


def test_an_override_with_spaces_around_its_key_says_so():
    """``hdet-train "train.steps = 30"`` is not "train.steps : unknown key"."""
    from hdet_scale.train.config import load_run_config

    for given in ("train.steps = 30", "train.steps =30", " train.steps=30"):
        with pytest.raises(HDETConfigError) as e:
            load_run_config(None, [given])
        assert str(e.value) == f"override {given!r}: spaces around the key; write train.steps=30 (no spaces around '=')"
    assert load_run_config(None, ["train.steps= 30"])["train"]["steps"] == 30  # a value's space: YAML drops it


def test_a_validation_split_read_over_and_over_gets_a_note(tmp_path):
    """A small validation split evaluated on overlapping windows (each byte read about 8
    times) gets a note. The note gives the counts the loop reads (16 eval batches over 4
    ranks x 8 windows of 129 bytes = 16512 bytes); a split larger than that gets
    none."""
    import random

    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    rng = random.Random(0)

    def warned(size):
        data = tmp_path / f"corpus_{size}.txt"
        data.write_text("".join(rng.choice("abcdefgh \n") for _ in range(size)))
        run = load_run_config(None, [f"data.path={data}", "data.val_fraction=0.1", "train.steps=100",
                                     f"run_dir={tmp_path / 'run'}", "wandb.enabled=false"])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            validate(run, 4, build_model=False)
        return run, [str(w.message) for w in seen if "validation loss reads" in str(w.message)]

    run, got = warned(20_000)
    val = len(__import__("hdet_scale.train.data", fromlist=["load_corpus"]).load_corpus(
        run["data"]["path"], 0.1, run["data"]["max_bytes"], run["seed"], run["run_dir"]).val)
    assert 1000 < val < 16512  # the split the note must name, counted independently
    assert got == [f"hdet_scale: train.eval_batches=16: the validation loss reads 128 windows of data.seq_len+1=129 "
                   f"bytes from a validation split of {val} bytes (data.val_fraction=0.1): they overlap, each byte is "
                   f"read about {16512 / val:.1f} times, and the loss rests on those {val} bytes (a larger "
                   "data.val_fraction or more data for a steadier one)"]
    assert warned(400_000)[1] == []  # 40 kB of validation bytes hold the 16512 read


def test_a_config_file_with_an_equals_sign_in_its_name_is_read_as_the_file(tmp_path, monkeypatch, capsys):
    """hdet-train 'a=b.yaml' (an existing file) reads the file, not the override a=b.yaml
    ("a: unknown key"): its own error (a bad value in it) names its key, as for any
    config file; a name that is no file stays an override."""
    from hdet_scale.train import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a=b.yaml").write_text("train:\n  steps: -3\n")
    assert cli.main(["a=b.yaml", "wandb.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "train.steps" in err and "a: unknown key" not in err, err
    assert cli.main(["c=d.yaml", "wandb.enabled=false"]) == 2  # no such file: an override, refused as before
    assert "c: unknown key" in capsys.readouterr().err


def test_settings_of_what_the_run_does_not_do_get_a_note():
    """auto.* with auto-LR off, warm_init.* with warm init off, keep_checkpoints without
    checkpoint_every, overlap_gradient_sharing=false and model.sharded_init=false on ddp
    would each run without a word: one note each; none for the packaged values left as
    they are, nor when the feature is on."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.run_notes import never_notes

    base = ["wandb.enabled=false", "backend=ddp"]
    assert never_notes(load_run_config(None, [*base, "deepspeed.hdet.auto.enabled=false"])) == []
    run = load_run_config(None, [*base, "deepspeed.hdet.auto.enabled=false", "deepspeed.hdet.auto.temperature=0.5",
                                 "deepspeed.hdet.auto.controller=paper", "deepspeed.hdet.warm_init.nu=0.05",
                                 "train.keep_checkpoints=5", "deepspeed.hdet.overlap_gradient_sharing=false",
                                 "model.sharded_init=false"])
    assert never_notes(run) == [
        "deepspeed.hdet.auto.controller=paper, deepspeed.hdet.auto.temperature=0.5 have no effect: "
        "deepspeed.hdet.auto.enabled is false (set it to true to use them)",
        "deepspeed.hdet.warm_init.nu=0.05 has no effect: deepspeed.hdet.warm_init.enabled is false (set it to true to "
        "use it)",
        "train.keep_checkpoints=5 has no effect: without train.checkpoint_every the run saves one checkpoint, at its "
        "end (set train.checkpoint_every=N to save every N steps and keep the newest keep_checkpoints)",
        "deepspeed.hdet.overlap_gradient_sharing=false is read by the deepspeed backend only: ddp overlaps its own "
        "gradient all-reduce whatever it says",
        "model.sharded_init=false has no effect on ddp, which builds the whole model on every rank either way"]
    on = load_run_config(None, ["wandb.enabled=false", "backend=deepspeed", "deepspeed.hdet.auto.temperature=0.5",
                                "deepspeed.hdet.warm_init.enabled=true", "deepspeed.hdet.warm_init.nu=0.05",
                                "train.keep_checkpoints=5", "train.checkpoint_every=50",
                                "deepspeed.hdet.overlap_gradient_sharing=false", "model.sharded_init=false"])
    assert never_notes(on) == []
    # keep_checkpoints with train.checkpoint=false, and warm init with nu=0
    off = load_run_config(None, [*base, "train.checkpoint=false", "train.keep_checkpoints=5",
                                 "deepspeed.hdet.warm_init.enabled=true", "deepspeed.hdet.warm_init.nu=0"])
    assert never_notes(off) == [
        "deepspeed.hdet.warm_init.nu=0 adds no noise: warm init with it on changes nothing (the replicas start equal, "
        "as with warm_init.enabled=false); the paper uses nu=0.01",
        "train.keep_checkpoints=5 has no effect: train.checkpoint=false saves no checkpoint"]


def test_a_new_schedule_name_leaves_out_the_files_keys_of_the_old_schedule():
    """A new schedule name is a new schedule, as a new ``optimizer.type`` is a new
    optimizer: ``deepspeed.hdet.schedule.name=constant`` over the packaged OneCycle block
    leaves out the file's keys of the old one with a note, rather than warning that
    ``final_div_factor=10.0`` and ``pct_start=0.2`` are not read, "remove them", which no
    override can do (``=null`` is refused as not a float). Keys the user sets beside the
    name stay (and are warned about when unread); the same name, or none, drops nothing."""
    from hdet_scale.config import HDETConfig
    from hdet_scale.train.start_notes import switch_notes as _switch_notes
    from hdet_scale.train.config import load_run_config

    run = load_run_config(None, [f"deepspeed_config={ADAMW}", "deepspeed.hdet.schedule.name=constant"])
    assert run["deepspeed"]["hdet"]["schedule"] == {"name": "constant", "total_steps": 300}
    assert HDETConfig.from_dict(run["deepspeed"]["hdet"]).schedule_unused_warning is None
    assert _switch_notes(run) == [f"deepspeed.hdet.schedule.name=constant replaces {ADAMW}'s "
                                  "onecycle schedule: its pct_start, final_div_factor are onecycle's and left out"]
    run = load_run_config(None, [f"deepspeed_config={ADAMW}", "deepspeed.hdet.schedule.name=constant",
                                 "deepspeed.hdet.schedule.pct_start=0.25"])
    assert run["deepspeed"]["hdet"]["schedule"]["pct_start"] == 0.25  # the user's own: kept, and warned about
    assert "pct_start=0.25" in HDETConfig.from_dict(run["deepspeed"]["hdet"]).schedule_unused_warning
    for same in ([], ["deepspeed.hdet.schedule.name=onecycle"], ["deepspeed.hdet.schedule.pct_start=0.25"]):
        run = load_run_config(None, [f"deepspeed_config={ADAMW}", *same])
        assert "final_div_factor" in run["deepspeed"]["hdet"]["schedule"] and _switch_notes(run) == [], same


def test_the_old_bfloat16_block_and_adam_w_mode_false_under_adamw_are_refused():
    """A DeepSpeed JSON with DeepSpeed's old block name "bfloat16" would train FSDP2 in
    float32 (hdet_scale reads "bf16") and the cost report say fp32, without a word;
    ``adam_w_mode: false`` under type AdamW is ignored by DeepSpeed. Both refused,
    naming the key and the fix; their right forms pass."""
    from hdet_scale.ds_values import check_deepspeed_values

    with pytest.raises(HDETConfigError, match=r"deepspeed.bfloat16: DeepSpeed's old name of the bf16 block.*rename "
                                              r"it to bf16"):
        check_deepspeed_values({"bfloat16": {"enabled": True}}, prefix="deepspeed.")
    with pytest.raises(HDETConfigError, match=r"optimizer.params.adam_w_mode: false is ignored under type AdamW"):
        check_deepspeed_values({"optimizer": {"type": "adamw", "params": {"lr": 1e-3, "adam_w_mode": False}}})
    check_deepspeed_values({"bf16": {"enabled": True},
                            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}})
    check_deepspeed_values({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "adam_w_mode": True}}})


def test_a_probe_nothing_calls_is_a_warning():
    """probe= beside auto.fitness 'train_loss' would be accepted and never called: a
    warning says so (HDETTrainer and prepare). A probe with the probe fitness, or no
    probe with train_loss, says nothing."""
    import warnings

    from hdet_scale.config import HDETConfig
    from hdet_scale.probe import require_probe

    def cfg(**auto):
        return HDETConfig.from_dict({"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": 0.5}},
                                     "schedule": {"total_steps": 10}, "auto": {"enabled": True, **auto}})

    def said(c, probe):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            require_probe(c, probe, "probe", "probe(model) -> loss", 1)
        return [str(w.message) for w in seen if "never called" in str(w.message)]

    probe = lambda model: 0.0  # noqa: E731
    msgs = said(cfg(fitness="train_loss"), probe)
    assert len(msgs) == 1 and "hdet.auto.fitness is 'train_loss'" in msgs[0] and "drop probe" in msgs[0], msgs
    off = said(cfg(enabled=False), probe)[0]
    assert "auto-LR scores no replicas" in off and "fitness='probe'" not in off, off  # auto-LR off: no fitness advice
    assert said(cfg(fitness="probe"), probe) == [] and said(cfg(fitness="train_loss"), None) == []


def test_a_group_at_zero_beside_explored_ones_is_said():
    """HDETTrainer's no-decay group (weight_decay 0) under a weight_decay axis stays 0 in
    every replica (only its group_1 = 0 records show it): kept at 0, and said once; with
    the groups named, or every group nonzero, nothing is said."""
    import warnings

    from hdet_scale.autolr import check_additive_floors

    wd = HDETConfig.from_dict({"replicas": 2, "axes": {"weight_decay": {"spread_ratio": 0.5}},
                               "schedule": {"total_steps": 100}})

    def said(bases):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            check_additive_floors(wd, build_schedule(wd), bases)
        return [str(w.message) for w in seen]

    msgs = said({("weight_decay", 0): 0.01, ("weight_decay", 1): 0.0, ("weight_decay", 2): 0.0})
    assert len(msgs) == 1 and "parameter group(s) [1, 2] have weight_decay 0" in msgs[0] \
        and "set axes.weight_decay.groups=[0]" in msgs[0], msgs
    assert said({("weight_decay", 0): 0.01}) == []
    assert said({("weight_decay", 0): 0.01, ("weight_decay", 1): 0.02}) == []


@pytest.mark.parametrize("text", ["{}\n", "", "# nothing yet\n"])
def test_a_config_file_without_settings_is_noted(tmp_path, capsys, monkeypatch, text):
    """``hdet-train empty.json`` (a file holding ``{}``) does not start the full default
    job without a word: one note on stderr says the file holds no settings; a file with
    one says nothing; the run config is the defaults either way."""
    from hdet_scale.train.config import load_run_config

    monkeypatch.delenv("RANK", raising=False)
    empty, one = tmp_path / "empty.yaml", tmp_path / "one.yaml"
    empty.write_text(text)
    one.write_text("seed: 3\n")
    assert load_run_config(str(empty), []) == load_run_config(None, [])
    assert "holds no settings" in capsys.readouterr().err
    load_run_config(str(one), [])
    assert "holds no settings" not in capsys.readouterr().err


def test_hdet_train_prints_the_paper_controllers_decay_warning_before_the_ranks_start(monkeypatch, capsys):
    """The 'paper' controller's decay outrunning its meta-update is warned of by the
    checks (hdet-train, as hdet-dryrun and prepare() do), not only where the controller
    is built, in the ranks, which drop the config warnings (the launcher prints those of
    the checks once), so hdet-train would say nothing. The log controller's run (same
    settings otherwise) warns of nothing."""
    from hdet_scale.train.cli import _validate_once
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    monkeypatch.delenv("RANK", raising=False)
    for controller, warned in (("paper", True), ("log", False)):
        run = load_run_config(None, [f"deepspeed_config={ADAMW}", f"deepspeed.hdet.auto.controller={controller}",
                                     "train.steps=40", "wandb.enabled=false"])
        capsys.readouterr()
        _validate_once(lambda r, w: validate(r, w, build_model=False), run, 4, True)
        err = capsys.readouterr().err
        assert ("hdet-train: warning: hdet.auto: the decay (auto.decay='auto') cuts the base LR" in err) == warned, err
        assert ("piecewise-constant decay" in err) == warned, err


@pytest.mark.parametrize("project", ["", "  "])
def test_an_empty_wandb_project_is_refused_not_the_fallback_project(project):
    """``wandb.project=`` (an unset shell variable) would run, without a word, into the
    project "hdet" (the logger's fallback), not hdet-train's "hdet-scale": refused like
    an empty run_dir, by hdet-train before any rank starts (the whole command:
    test_bad_inputs) and by the library's block; W&B off reads nothing."""
    pytest.importorskip("wandb")
    from hdet_scale.config import WandbConfig
    from hdet_scale.logging import check_wandb_settings
    from hdet_scale.train import cli

    with pytest.raises(HDETConfigError, match=r"^wandb.project: empty \('.*'; an unset shell variable\?\)"):
        check_wandb_settings(WandbConfig(enabled=True, mode="offline", project=project))
    check_wandb_settings(WandbConfig(enabled=False, project=project))
    with pytest.raises(HDETConfigError, match=r"^wandb.project: empty value \('wandb.project=.*'; an unset shell "
                       r"variable\?\): give a W&B project name, or leave wandb.project out for the default "
                       r"\(hdet-scale\)"):
        cli._check_empty_overrides([f"wandb.project={project}"])  # hdet-train's: the value reads as null there
