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
