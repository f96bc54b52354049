"""``hdet-dryrun``: a config checked for a world we do not have, per backend."""

from __future__ import annotations

import json

import pytest

from hdet_scale.dryrun import describe, main
from hdet_scale.errors import HDETConfigError

BLOCK = {"replicas": 4, "sync_interval": 100, "axes": {"lr": {"spread_ratio": 0.3}},
         "schedule": {"name": "onecycle", "total_steps": 1000}, "auto": {"enabled": True, "warmup_steps": 500}}
ZERO3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "hdet": BLOCK}


def test_deepspeed_report_names_groups_and_multipliers():
    text = describe(ZERO3, world_size=256)
    assert "world 256 = 4 replicas x 64 shards" in text
    assert "replica group 63: ranks [63, 127, 191, 255]" in text
    assert "multipliers [0.7, 0.9, 1.1, 1.3]" in text
    assert "shard group of 64 ranks): ZeRO-3 partitions" in text


@pytest.mark.parametrize("backend", ["fsdp2", "ddp", "fairscale"])
def test_other_backends_check_the_hdet_block_only(backend):
    # ZeRO stage 2 is DeepSpeed's business: refused for deepspeed, ignored here.
    cfg = {**ZERO3, "zero_optimization": {"stage": 2}}
    with pytest.raises(HDETConfigError, match="zero_optimization.stage"):
        describe(cfg, world_size=8)
    text = describe(cfg, world_size=8, backend=backend)
    assert "world 8 = 4 replicas x 2 shards" in text and backend in text


def test_cli_exit_codes_and_errors(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO3))
    assert main([str(path), "--world-size", "8", "--backend", "fsdp2"]) == 0
    assert "2 shards" in capsys.readouterr().out
    assert main([str(path), "--world-size", "6"]) == 2
    assert "hdet.replicas" in capsys.readouterr().err
    bad = {**ZERO3, "hdet": {**BLOCK, "sync_interval": 0}}
    path.write_text(json.dumps(bad))
    assert main([str(path), "--world-size", "8", "--backend", "ddp"]) == 2
    assert "hdet.sync_interval" in capsys.readouterr().err


@pytest.mark.parametrize("config,world,backend,needle", [
    (ZERO3, 0, "fsdp2", "--world-size"),
    ([1, 2], 8, "deepspeed", "JSON"),
    ({**ZERO3, "hdet": [1]}, 8, "ddp", "hdet: expected an object"),
    ({k: v for k, v in ZERO3.items() if k != "hdet"}, 8, "fsdp2", "no hdet block"),
])
def test_bad_input_is_a_config_error(config, world, backend, needle):
    with pytest.raises(HDETConfigError, match=needle):
        describe(config, world_size=world, backend=backend)


def test_no_hdet_block_is_plain_deepspeed_and_total_steps_must_agree():
    assert describe({k: v for k, v in ZERO3.items() if k != "hdet"}, 8) == "no hdet block: plain DeepSpeed"
    with pytest.raises(HDETConfigError, match="--total-steps 500 differs"):
        describe(ZERO3, 8, total_steps=500)
    assert "world 8" in describe(ZERO3, 8, total_steps=1000)


@pytest.mark.parametrize("params", [{"lr": -1}, {"lr": "abc"}, {"lr": float("nan")}, {"lr": True},
                                    {"lr": 1e-3, "betas": [0.9]}, {"lr": 1e-3, "weight_decay": -0.1}])
@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2"])
def test_optimizer_values_are_refused_as_hdet_train_refuses_them(params, backend, tmp_path):
    """Issue 9: hdet-dryrun said 0 for an LR of -1 or "abc" that hdet-train refuses. Both now
    run the same check (ds_values.check_deepspeed_values): the dry run's lines are the
    trainer's, without its ``deepspeed.`` prefix, for every backend (the trainer's engines
    all read the optimizer block)."""
    from hdet_scale.train.config import load_run_config

    cfg = {**ZERO3, "optimizer": {"type": "AdamW", "params": params}}
    with pytest.raises(HDETConfigError) as dry:
        describe(cfg, world_size=8, backend=backend)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(HDETConfigError) as train:
        load_run_config(None, [f"deepspeed_config={path}", f"backend={backend}"])
    lines = [line.strip() for line in str(dry.value).splitlines()[1:]]
    assert lines and lines == [line.strip().removeprefix("deepspeed.") for line in str(train.value).splitlines()[1:]]
    assert all(line.startswith("optimizer.params.") for line in lines), lines


def test_a_fractional_total_steps_is_one_error(tmp_path, capsys):
    """Issue 9: ``"total_steps": 10.5`` printed "expected int | None, got 10.5", "must be an
    integer >= 1, got None" and a hint to pass --total-steps, although the file sets it. One
    line now; the hint stays for a file that leaves total_steps to the trainer."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO3, "hdet": {**BLOCK, "schedule": {"total_steps": 10.5}}}))
    assert main([str(path), "--world-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2:] == ["hdet-dryrun: error: invalid hdet config:",
                        "  hdet.schedule.total_steps: expected int | None, got 10.5"], err
    path.write_text(json.dumps({**ZERO3, "hdet": {**BLOCK, "schedule": {"name": "onecycle"}}}))
    assert main([str(path), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "total_steps: must be an integer >= 1" in err and "pass --total-steps" in err


@pytest.mark.parametrize("edit,line", [
    ({"bf16": True}, 'bf16: must be a JSON object, e.g. {"enabled": true}; got true'),
    ({"zero_optimization": 5}, 'zero_optimization: must be a JSON object, e.g. {"stage": 3}; got 5'),
    ({"optimizer": "AdamW"}, 'optimizer: must be a JSON object, e.g. {"type": "AdamW", "params": {"lr": 0.001}}; '
                             'got "AdamW"'),
])
def test_a_deepspeed_block_given_as_a_value_is_named(edit, line, capsys, tmp_path):
    """Issue 9: DeepSpeed fails on these with a TypeError naming no key (and the dry run's
    own key check raised an AttributeError on a text ``optimizer``)."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO3, **edit}))
    assert main([str(path), "--world-size", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"  {line}"


def test_auto_lr_summary_per_controller():
    """The log controller: the number of meta-updates (syncs at 500 .. 1000: 6) and how far
    the multiplier can move (6 x the default step 0.25 in log units = x4.48). The paper controller over the
    same 6 syncs: the derived decay 1 - (floor / value at step 500)^(1/6) (torch's OneCycle
    defaults: 0.87 per sync) dwarfs step_size x spread = 0.15: the warning says so."""
    from hdet_scale.schedules import OneCycle

    text = describe(ZERO3, world_size=8)
    assert "controller log, fitness probe, groups tied" in text
    assert "6 meta-updates (first at step 500)" in text
    assert "at most x4.48 / x0.223" in text
    paper = {**ZERO3, "hdet": {**BLOCK, "auto": {**BLOCK["auto"], "controller": "paper"}}}
    text = describe(paper, world_size=8)
    gamma = float(text.split("decay gamma per sync: ")[1].split()[0])
    oc = OneCycle(1000)
    assert gamma == pytest.approx(1 - (oc.floor(1.0) / oc.value(500, 1.0)) ** (1 / 6), rel=1e-5)
    assert "warning: hdet.auto: the decay" in text and "at most 15.00%" in text
    warm = {**ZERO3, "hdet": {**BLOCK, "warm_init": {"enabled": True, "nu": 0.02}}}
    assert "warm init: noise std nu=0.02" in describe(warm, world_size=8)
