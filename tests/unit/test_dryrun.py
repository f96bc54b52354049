"""``hdet-dryrun``: a config checked for a world we do not have, per backend."""

from __future__ import annotations

import json

import pytest
import torch

from hdet_scale.dryrun import describe, main
from hdet_scale.errors import HDETConfigError

BLOCK = {"replicas": 4, "sync_interval": 100, "axes": {"lr": {"spread_ratio": 0.3}},
         "schedule": {"name": "onecycle", "total_steps": 1000}, "auto": {"enabled": True, "warmup_steps": 500}}
# The optimizer block: the fsdp2 / ddp / fairscale engines build a torch optimizer from it
# and hdet-train refuses a file without one for them (engines.check_engine_config).
ZERO3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "hdet": BLOCK}


def test_deepspeed_report_names_groups_and_multipliers():
    text = describe(ZERO3, world_size=256)
    assert "world 256 = 4 replicas x 64 shards" in text
    assert "replica group 63: ranks [63, 127, 191, 255]" in text
    assert "multipliers [0.7, 0.9, 1.1, 1.3]" in text
    assert "shard group of 64 ranks): ZeRO-3 partitions" in text


@pytest.mark.parametrize("legacy,stage", [(True, 1), (False, 0)])
def test_zero_optimization_as_a_boolean_is_named_as_deepspeeds_old_form(legacy, stage):
    """``"zero_optimization": true`` (DeepSpeed reads it as stage 1) is not refused with
    "needs ZeRO stage 3 ..., got 0"."""
    with pytest.raises(HDETConfigError) as e:
        describe({**ZERO3, "zero_optimization": legacy}, world_size=8)
    assert (f"zero_optimization: {str(legacy).lower()} is DeepSpeed's old form of stage {stage}; hdet's DeepSpeed "
            'backend needs ZeRO stage 3: write "zero_optimization": {"stage": 3}') in str(e.value)
    assert "got 0" not in str(e.value)


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


def test_a_value_starting_with_a_dash_reaches_the_range_check(tmp_path, capsys):
    """``--params -7B`` and ``--params 0`` both get the range message (not argparse's
    "expected one argument", reading -7B as an option), and an option after a
    value-taking one is still an option."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO3))
    for value in ("-7B", "0", "-1e9"):
        assert main([str(path), "--world-size", "8", "--params", value]) == 2
        err = capsys.readouterr().err
        assert err == ("hdet-dryrun: error: --params: expected a whole number of parameters in [1, 1e+15] such as "
                       f"7e9, 7B or 125M, got '{value}'\n"), err
    with pytest.raises(SystemExit) as e:
        main([str(path), "--world-size", "8", "--params", "--precision", "fp32"])
    assert e.value.code == 2 and "--params/--model-params: expected one argument" in capsys.readouterr().err


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
    with pytest.raises(HDETConfigError, match="--total-steps 2000 is longer than hdet.schedule.total_steps=1000"):
        describe(ZERO3, 8, total_steps=2000)
    assert "world 8" in describe(ZERO3, 8, total_steps=500)  # the schedule's first 500 steps: a note
    assert "world 8" in describe(ZERO3, 8, total_steps=1000)


@pytest.mark.parametrize("params", [{"lr": -1}, {"lr": "abc"}, {"lr": float("nan")}, {"lr": True},
                                    {"lr": 1e-3, "betas": [0.9]}, {"lr": 1e-3, "weight_decay": -0.1}])
@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2"])
def test_optimizer_values_are_refused_as_hdet_train_refuses_them(params, backend, tmp_path):
    """hdet-dryrun and hdet-train run the same check on the optimizer block
    (ds_values.check_deepspeed_values), so an LR of -1 or "abc" that hdet-train refuses is
    no exit 0 of the dry run: its lines are the trainer's, without its ``deepspeed.``
    prefix, for every backend (the trainer's engines all read the optimizer block)."""
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
    """``"total_steps": 10.5`` is one line, not also "must be an integer >= 1, got None" and
    a hint to pass --total-steps although the file sets it; the hint stays for a file that
    leaves total_steps to the trainer."""
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
    """Each is named: DeepSpeed fails on these with a TypeError naming no key (and the dry
    run's own key check must not raise an AttributeError on a text ``optimizer``)."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO3, **edit}))
    assert main([str(path), "--world-size", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"  {line}"


def test_auto_lr_summary_per_controller():
    """The log controller: the number of meta-updates (syncs at 500 .. 1000: 6) and how far
    the multiplier can move within the run (the 5 before the last step, the velocity
    ramping up with momentum 0.5: 0.25 x sum_{k=1..5} (1 - 0.5^k) in log units = x2.74;
    test_log_reach_is_the_log_update_recurrence_with_g_plus_one), and only upward: OneCycle
    decays over every interval after its peak at step 300 (auto.decay_moves "up"). The paper controller over the
    same 6 syncs: the derived decay 1 - (floor / value at step 500)^(1/6) (torch's OneCycle
    defaults: 0.87 per sync) dwarfs step_size x spread = 0.15: the warning says so."""
    from hdet_scale.schedules import OneCycle

    text = describe(ZERO3, world_size=8)
    assert "controller log, fitness probe, groups tied" in text
    assert "6 meta-updates (first at step 500)" in text
    assert "at most x2.74 / x1 of the schedule within the run (over the 5 meta-updates before the last step" in text
    assert "during the schedule's decay it only rises (auto.decay_moves up): 0 meta-updates can lower it" in text
    paper = {**ZERO3, "hdet": {**BLOCK, "auto": {**BLOCK["auto"], "controller": "paper"}}}
    text = describe(paper, world_size=8)
    gamma = float(text.split("decay gamma per sync: ")[1].split()[0])
    oc = OneCycle(1000)
    assert gamma == pytest.approx(1 - (oc.floor(1.0) / oc.value(500, 1.0)) ** (1 / 6), rel=1e-5)
    assert "warning: hdet.auto: the decay" in text and "at most 15.00%" in text
    warm = {**ZERO3, "hdet": {**BLOCK, "warm_init": {"enabled": True, "nu": 0.02}}}
    assert "warm init: noise std nu=0.02" in describe(warm, world_size=8)


# ---- batch keys, repeated JSON keys, all errors at once, huge worlds ----------------------

@pytest.mark.parametrize("key", ["gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"])
@pytest.mark.parametrize("value", [-1, 0, 1.5, True, "8"])
def test_a_batch_key_that_is_not_a_positive_integer_is_one_line_everywhere(key, value, tmp_path):
    """``"gradient_accumulation_steps": -1`` (or 0) would get past an unchecked trainer
    to an AssertionError in every rank after 29-113 s, and 1.5 be refused inside the
    ranks under another key's name (the micro-batch, 12.0). The trainer, the dry run and
    the library's prepare_config refuse it with the same line, naming the key (the
    trainer's with its ``deepspeed.`` prefix)."""
    from hdet_scale.backends.deepspeed import prepare_config
    from hdet_scale.train.config import load_run_config

    cfg = {**ZERO3, key: value}
    what = {"gradient_accumulation_steps": "micro-steps per optimizer step",
            "train_micro_batch_size_per_gpu": "samples per rank per micro-step",
            "train_batch_size": "samples per optimizer step over all ranks"}[key]
    line = f"{key}: must be an integer >= 1 ({what}), got {value!r}"
    with pytest.raises(HDETConfigError) as dry:
        describe(cfg, world_size=8, backend="fsdp2")
    with pytest.raises(HDETConfigError) as lib:
        prepare_config(cfg, world_size=8)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(HDETConfigError) as train:
        load_run_config(None, [f"deepspeed_config={path}", "wandb.enabled=false"])
    assert str(dry.value).splitlines()[1:] == [f"  {line}"] == str(lib.value).splitlines()[1:]
    assert str(train.value).splitlines()[1:] == [f"  deepspeed.{line}"]


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2"])
def test_a_global_batch_that_does_not_match_the_world_names_the_product(backend):
    """``train_batch_size`` = micro x accumulation x W: 2 x 3 x 8 = 48 passes, 40 is one
    line naming the three values and the product, for every backend (the trainer's
    engines all read it)."""
    ok = {**ZERO3, "gradient_accumulation_steps": 3, "train_batch_size": 48}
    assert "world 8" in describe(ok, world_size=8, backend=backend)
    with pytest.raises(HDETConfigError) as e:
        describe({**ok, "train_batch_size": 40}, world_size=8, backend=backend)
    assert str(e.value).splitlines()[1:] == [
        "  train_batch_size: 40 must equal train_micro_batch_size_per_gpu (2) x gradient_accumulation_steps (3) x "
        "world size (8) = 48 (samples per optimizer step over all ranks)"]


def test_the_library_runs_the_value_checks():
    """A negative LR passed hdet_scale.initialize (prepare_config ran no value check); the
    same config with a positive LR passes."""
    from hdet_scale.backends.deepspeed import prepare_config

    cfg = {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert prepare_config(cfg, world_size=8)[0].replicas == 4
    with pytest.raises(HDETConfigError, match=r"optimizer.params.lr: must be a finite number > 0 \(the peak LR\), "
                                              r"got -0.001"):
        prepare_config({**cfg, "optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, world_size=8)


def test_a_key_twice_in_the_json_file_is_refused_by_the_library_and_the_dry_run(tmp_path, capsys):
    """A key given twice is refused by hdet-dryrun and hdet_scale.initialize as by
    hdet-train (json.load would keep the last "replicas" silently): all three read the
    file with ds_json.loads_json and name the file and the key; the same file without
    the repetition passes."""
    from hdet_scale.backends.deepspeed import prepare_config
    from hdet_scale.train.config import load_run_config

    text = json.dumps(ZERO3)
    path = tmp_path / "ds.json"
    path.write_text(text.replace('"replicas": 4', '"replicas": 4, "replicas": 2'))
    tail = "has the key 'replicas' twice in one object: keep one"
    with pytest.raises(HDETConfigError, match=f"DeepSpeed config '{path}' {tail}"):
        prepare_config(str(path), world_size=8)
    assert main([str(path), "--world-size", "8"]) == 2
    assert f"hdet-dryrun: error: DeepSpeed config '{path}' {tail}" in capsys.readouterr().err
    with pytest.raises(HDETConfigError, match=f"deepspeed_config: file '{path}' {tail}"):
        load_run_config(None, [f"deepspeed_config={path}", "wandb.enabled=false"])
    path.write_text(text)
    assert prepare_config(str(path), world_size=8)[0].replicas == 4
    assert main([str(path), "--world-size", "8"]) == 0


def test_without_total_steps_every_other_error_is_reported_too(capsys, tmp_path):
    """Without --total-steps the dry run reports more than the missing total_steps: one
    message, that line, then what the same file with --total-steps reports (a scheduler
    block, ZeRO stage 2)."""
    bad = {**ZERO3, "zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {}},
           "hdet": {**BLOCK, "schedule": {"name": "onecycle"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bad))
    assert main([str(path), "--world-size", "8", "--total-steps", "1000"]) == 2
    given = capsys.readouterr().err.strip().splitlines()
    assert main([str(path), "--world-size", "8"]) == 2
    missing = capsys.readouterr().err.strip().splitlines()
    assert len(given) == 3 and given[1].startswith("  scheduler:") and given[2].startswith("  zero_optimization.stage")
    assert missing == ["hdet-dryrun: error: invalid config:",
                       "  hdet.schedule.total_steps: must be an integer >= 1; the file leaves it to the trainer "
                       "(hdet-train sets it from train.steps, HDETTrainer from max_steps): pass --total-steps N (the "
                       "checks that depend on the run length were not run)"] + given[1:]


@pytest.mark.parametrize("value,rc,line", [
    ('"1000"', 2, "  hdet.schedule.total_steps: expected int | None, got '1000'"),  # was "1000 differs from 1000" too
    ('"auto"', 0, None),  # the trainer's to fill: --total-steps stands for it
    ("1000", 0, None),
    # a longer schedule than the run is HDETTrainer's warning, not an error
    ("5000", 0, None),
    ("500", 2, "  --total-steps 1000 is longer than hdet.schedule.total_steps=500 in the file: the schedule must "
               "cover the run (HDETTrainer and hdet-train refuse it)"),
])
def test_total_steps_of_another_type_is_named_once(capsys, tmp_path, value, rc, line):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO3, "hdet": {**BLOCK, "schedule": {"name": "onecycle"}}}).replace(
        '"schedule": {"name": "onecycle"}', f'"schedule": {{"name": "onecycle", "total_steps": {value}}}'))
    assert main([str(path), "--world-size", "8", "--total-steps", "1000"]) == rc
    err = capsys.readouterr().err.strip().splitlines()
    if value == "5000":
        assert "hdet-dryrun: note: --total-steps 1000 < hdet.schedule.total_steps=5000: the run covers the " \
               "schedule's first 1000 steps" in "\n".join(err), err
    if line is not None:
        assert err[:2] == ["hdet-dryrun: error: invalid config:" if "longer" in line else
                           "hdet-dryrun: error: invalid hdet config:", line], err


@pytest.mark.parametrize("world", range(1, 41))
def test_the_plan_is_the_layouts_for_small_worlds(world):
    """The bounded plan (dryrun.layout_report) is Layout.describe's text wherever every
    group and rank is listed (up to 8 of each), for every replica count dividing W."""
    from hdet_scale.dryrun import layout_report
    from hdet_scale.topology import Layout

    for r in (r for r in range(1, world + 1) if world % r == 0 and max(r, world // r) <= 8):
        assert layout_report(world, r) == Layout(world, r).describe()


def test_the_plan_of_a_large_world_lists_the_ends_of_what_layout_lists():
    """W = 2 x 500 (1000 replica groups, shard groups of 500 ranks) and R = 1000 (the
    per-replica multipliers): the lines shown are Layout's and axes.multipliers' own,
    the rest is counted."""
    from hdet_scale import axes
    from hdet_scale.dryrun import _per_replica, layout_report
    from hdet_scale.topology import Layout

    text = layout_report(1000, 2).splitlines()
    lay = Layout(1000, 2)
    s0 = lay.shard_group_ranks(0)
    assert text[1] == f"  shard group   0: ranks [{s0[0]}, {s0[1]}, {s0[2]}, ... 496 more ..., {s0[-1]}] (500 ranks)"
    assert text[3:8] == [f"  replica group {j}: ranks {lay.replica_group_ranks(j)}" for j in range(3)] + [
        "  ... 496 more replica groups ...", f"  replica group 499: ranks {lay.replica_group_ranks(499)}"]
    m = [round(x, 6) for x in axes.multipliers(1000, 0.3)]
    assert _per_replica(1000, lambda o: 1.0 + 0.3 * o) == f"[{m[0]}, {m[1]}, {m[2]}, ... 996 more ..., {m[-1]}] (1000 replicas)"


@pytest.mark.parametrize("replicas", [2, 10**6])
def test_a_huge_world_is_described_in_bounded_time_and_lines(replicas):
    """--world-size 10**9 must not run out of memory (23 GB) building every group, nor
    10**6 print 500k lines: W = 10**12 takes well under a second here (the bound
    asserted, 5 s, leaves room for a loaded machine; building every group would take
    hours) and prints a fixed number of lines, whatever R."""
    import time

    cfg = {**ZERO3, "hdet": {**BLOCK, "replicas": replicas}}
    start = time.perf_counter()
    text = describe(cfg, world_size=10**12)
    assert time.perf_counter() - start < 5
    assert len(text.splitlines()) < 30
    assert f"world {10**12} = {replicas} replicas x {10**12 // replicas} shards" in text
    assert f"({replicas} replicas)" in text if replicas > 8 else "multipliers [0.7, 1.3]" in text


@pytest.mark.parametrize("edit,backend,deepspeed_ok", [
    # Lion, not Lamb: DeepSpeed's ZeRO refuses Lamb without zero_allow_untested_optimizer
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-3}}}, "ddp", True),
    ({"optimizer": None, "fp16": {"enabled": True}}, "fsdp2", True),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}}, "ddp", False),
    ({"bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {}}}, "fairscale", False),
    # DeepSpeed-only memory and precision keys, which the other engines would ignore silently
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "fsdp2", False),
    ({"torch_autocast": {"enabled": True}, "communication_data_type": "fp16"}, "ddp", False),
])
def test_engine_checks_are_hdet_trains(edit, backend, deepspeed_ok, tmp_path, capsys):
    """``hdet-dryrun --backend ddp`` refuses a Lamb optimizer, SGD given betas, fp16 or a
    scheduler block, as hdet-train does for that engine: the dry run runs the trainer's
    check (``engines.check_engine_config``): exit 2, and its lines are exactly the
    trainer's (``loop.validate``) without the ``deepspeed.`` prefix."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    cfg = {k: v for k, v in {**ZERO3, **edit}.items() if v is not None}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert main([str(path), "--world-size", "8", "--backend", backend]) == 2
    dry = capsys.readouterr().err.strip().splitlines()
    run = load_run_config(None, [f"deepspeed_config={path}", f"backend={backend}", f"data.path={path}"])
    with pytest.raises(HDETConfigError) as train:
        validate(run, 8)
    lines = [line.strip().removeprefix("deepspeed.") for line in str(train.value).splitlines()[1:]]
    assert lines and [line.strip() for line in dry[1:]] == lines, (dry, lines)
    # the same file passes for the engine that supports it (DeepSpeed: Lion, fp16, a scheduler)
    if deepspeed_ok:
        assert main([str(path), "--world-size", "8", "--backend", "deepspeed"]) == 0


@pytest.mark.parametrize("backend,stage,noted", [("fsdp2", 1, True), ("fsdp2", 3, False), ("ddp", 3, True),
                                                 ("ddp", 0, False), ("fairscale", 1, False), ("deepspeed", 3, False)])
def test_a_zero_stage_the_engine_does_not_follow_is_noted(backend, stage, noted, tmp_path, capsys):
    """``zero_optimization.stage`` under another engine stays allowed (one file for every
    engine), but a stage that shards more or less than the engine does gets one note
    line, and the run goes on (exit 0); the stage the engine matches (FSDP2 3, fairscale
    OSS 1, DDP 0) gets none."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO3, "zero_optimization": {"stage": stage}}))
    assert main([str(path), "--world-size", "8", "--backend", backend]) == 0
    err = capsys.readouterr().err
    assert (f"hdet-dryrun: note: zero_optimization.stage={stage} is DeepSpeed's and is not read by the {backend} "
            "backend, which" in err) is noted, err


def test_a_yaml_file_gets_a_hint(tmp_path, capsys):
    """``hdet-dryrun run.yaml`` says more than "Expecting value: line 1 column 1": a file
    that looks like YAML (by its name or a first line ``key:``) says what it probably is; a
    JSON file cut short does not get the hint."""
    text = "# a run\ntrain:\n  steps: 10\nrun_dir: x\n"
    for name in ("run.yaml", "run.json"):
        (tmp_path / name).write_text(text)
        assert main([str(tmp_path / name), "--world-size", "4"]) == 2
        err = capsys.readouterr().err
        assert "Expecting value" in err and "this looks like YAML (an hdet-train run config?)" in err, err
    (tmp_path / "cut.json").write_text('{"hdet": ')
    assert main([str(tmp_path / "cut.json"), "--world-size", "4"]) == 2
    assert "YAML" not in capsys.readouterr().err
    # random bytes, or nothing, in a .yaml are not "this looks like YAML"
    (tmp_path / "bin.yaml").write_bytes(bytes([0xAA, 0x00, 0xFF]) * 100)
    (tmp_path / "empty.yaml").write_text("  \n")
    for name, what in (("bin.yaml", "it is not UTF-8 text (byte 0): is it the right file?"),
                       ("empty.yaml", "the file is empty; it must hold a DeepSpeed JSON object")):
        assert main([str(tmp_path / name), "--world-size", "4"]) == 2
        err = capsys.readouterr().err
        assert f"cannot read the DeepSpeed JSON {str(tmp_path / name)!r}: {what}" in err and "YAML" not in err, err


@pytest.mark.parametrize("backend", ["deepspeed", "ddp"])
def test_a_layout_error_is_reported_with_the_blocks_other_errors(backend, recwarn):
    """3 replicas on 4 ranks is reported with the spread error beside it, not once that
    is fixed; an idle axis' warning comes once (no raw UserWarning too); modules /
    groups are said to be the engine's to check."""
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              **({"zero_optimization": {"stage": 3}} if backend == "deepspeed" else {}),
              "hdet": {"replicas": 3, "axes": {"lr": {"spread_ratio": 1.5}}, "schedule": {"total_steps": 100}}}
    with pytest.raises(HDETConfigError) as err:
        describe(json.loads(json.dumps(config)), world_size=4, backend=backend)
    lines = str(err.value).splitlines()
    assert lines[1].strip().startswith("hdet.replicas: 3 replicas do not divide the world of 4 ranks"), lines
    assert any(line.strip().startswith("hdet.axes.lr.spread_ratio: must be in [0, 1)") for line in lines), lines
    idle = {**config, "hdet": {"replicas": 2, "sync_interval": 5, "schedule": {"total_steps": 100},
                               "auto": {"enabled": True, "warmup_steps": 10},
                               "axes": {"lr": {"spread_ratio": 0.1, "groups": [0]},
                                        "temperature": {"spread_ratio": 0.0, "auto": True, "modules": ["x.*"]}}}}
    report = describe(idle, world_size=4, backend=backend)
    assert report.count("auto is true but spread_ratio is 0") == 1, report
    assert not [w for w in recwarn if "spread_ratio is 0" in str(w.message)], [str(w.message) for w in recwarn]
    assert "  modules ['x.*']: matched against the model's module names when the engine binds" in report, report
    assert "  groups [0]: checked against the optimizer's parameter groups when the engine starts" in report, report


def test_hf_config_checks_the_modules_patterns_on_its_model(tmp_path):
    """With --hf-config the dry run builds the model, so it checks ``modules`` patterns
    on it (refused as hdet-train refuses them, not "hdet-dryrun has no model" and exit
    0); a config.json holding a list is named, not Python's "dictionary update sequence"
    message."""
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}))
    config = {**ZERO3, "hdet": {**BLOCK, "axes": {"lr": {"spread_ratio": 0.1},
                                                  "temperature": {"spread_ratio": 0.1, "modules": ["zzz"]}}}}
    options = {"params": None, "hf_config": str(hf), "precision": None, "bandwidth_gbps": None, "step_seconds": None}
    with pytest.raises(HDETConfigError, match=r"hdet.axes.temperature.modules: \['zzz'\] match no module name of "
                                              "LlamaForCausalLM"):
        describe(json.loads(json.dumps(config)), world_size=8, cost=options)
    config["hdet"]["axes"]["temperature"]["modules"] = ["model.layers.*.self_attn"]
    text = describe(json.loads(json.dumps(config)), world_size=8, cost=options)
    assert "modules ['model.layers.*.self_attn']: each matches modules the axis sets in --hf-config's model" in text
    assert "(hdet-dryrun has no model: --hf-config checks them)" in describe(json.loads(json.dumps(config)), 8)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(HDETConfigError, match=r"--hf-config: .*list.json' must hold a JSON object .*got a list"):
        describe(json.loads(json.dumps(config)), world_size=8, cost={**options, "hf_config": str(tmp_path / "list.json")})


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 256}


@pytest.mark.parametrize("edit,line", [
    ({"num_hidden_layers": 0, "vocab_size": 0},
     "has num_hidden_layers=0 and vocab_size=0: a causal LM needs at least 1 layer and a vocabulary of at least "
     "1 token"),
    ({"num_hidden_layers": -3}, "has num_hidden_layers=-3: a causal LM needs at least 1 layer"),
    ({"intermediate_size": 0}, "has intermediate_size=0: a causal LM needs an MLP width of at least 1"),
    ({"hidden_size": 0, "num_attention_heads": 0, "head_dim": 0},
     "has hidden_size=0, num_attention_heads=0 and head_dim=0: a causal LM needs a hidden size of at least 1, "
     "at least 1 attention head and a head dimension of at least 1"),
    ({"num_key_value_heads": 0, "max_position_embeddings": 0},
     "has num_key_value_heads=0 and max_position_embeddings=0: a causal LM needs at least 1 key/value head and "
     "at least 1 position"),
    ({"model_type": "gpt2", "n_layer": 0, "n_embd": 64, "n_head": 4, "n_inner": 0},
     "has n_layer=0 and n_inner=0: a causal LM needs at least 1 layer and an MLP width of at least 1"),
])
def test_an_hf_config_with_a_size_below_one_is_refused_naming_every_key(edit, line, tmp_path, capsys):
    """Sizes that build no model are refused: ``num_hidden_layers=0, vocab_size=0``
    would build a 64-parameter model (the final norm) and the dry run exit 0 costing it;
    transformers also builds 0 (or negative) layers and MLP widths, and GPT-2's 0
    layers; hidden_size / heads 0 would be a ZeroDivisionError naming no key. Exit 2,
    one line naming the file and every key, before transformers prints its "bos_token_id
    must be ... within the vocabulary"."""
    pytest.importorskip("transformers")
    ds, hf = tmp_path / "ds.json", tmp_path / "zero.json"
    ds.write_text(json.dumps(ZERO3))
    cfg = {k: v for k, v in {**LLAMA, **edit}.items()
           if edit.get("model_type", "llama") == "llama" or k not in ("hidden_size", "num_attention_heads",
                                                                       "num_hidden_layers", "intermediate_size")}
    hf.write_text(json.dumps(cfg))
    assert main([str(ds), "--world-size", "4", "--hf-config", str(hf)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"hdet-dryrun: error: --hf-config: {str(hf)!r} {line}", captured.err
    assert "parameters" not in captured.out


def test_a_negative_size_transformers_refuses_keeps_its_message(tmp_path):
    """A negative that transformers refuses itself keeps its "negative dimension" line
    (tests/distributed/test_bad_inputs.py dryrun_hf_config_negative); with a 0 beside it
    every bad key is listed at once."""
    pytest.importorskip("transformers")
    from hdet_scale.cost import size_of_hf_config

    with pytest.raises(HDETConfigError, match=r"^--hf-config: 'config dict' does not build a causal LM: .*negative "
                                              "dimension"):
        size_of_hf_config({**LLAMA, "hidden_size": -64})
    with pytest.raises(HDETConfigError, match=r"^--hf-config: 'config dict' has hidden_size=-64 and vocab_size=0: a "
                                              "causal LM needs a hidden size of at least 1 and a vocabulary of at "
                                              "least 1 token$"):
        size_of_hf_config({**LLAMA, "hidden_size": -64, "vocab_size": 0})


def test_an_hf_config_with_sizes_of_one_still_builds(tmp_path):
    """The size check refuses below 1 only: a one-layer, one-token, one-head model is
    small, not degenerate, and ``null`` / absent keys keep transformers' defaults."""
    from hdet_scale.cost import size_of_hf_config

    tiny = {**LLAMA, "num_hidden_layers": 1, "vocab_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": None, "intermediate_size": 1, "max_position_embeddings": 1}
    assert size_of_hf_config(tiny).params > 0


def test_a_trainers_auto_values_are_explained_once():
    """A Hugging Face Trainer's DeepSpeed JSON ("auto" everywhere) gets one closing line
    that counts the "auto" values and says who fills them, not eight "must be a finite
    number" lines with only bf16.enabled saying where "auto" comes from."""
    from hdet_scale.ds_values import check_deepspeed_values

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    with pytest.raises(HDETConfigError) as e:
        check_deepspeed_values(ds)
    lines = str(e.value).splitlines()
    assert lines[-1] == ('  (5 value(s) above are "auto": the Hugging Face Trainer fills those when it starts '
                         '(hdet_scale.hf.HDETTrainer, docs/hf_trainer.md); elsewhere write the numbers)'), lines
    with pytest.raises(HDETConfigError) as e:
        check_deepspeed_values({"bf16": {"enabled": "auto"}})  # one, explained on its own line: no summary
    assert "value(s) above" not in str(e.value)


def test_a_config_for_hdet_trainer_is_dry_run_without_its_auto_values(tmp_path, capsys):
    """A DeepSpeed JSON written for HDETTrainer ("auto" values) can be dry-run (not
    every "auto" an error): it is checked as HDETTrainer checks it, without them, with
    one note naming them; its real errors are still found."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "hdet": {"replicas": 2, "sync_interval": 10, "axes": {"lr": {"spread_ratio": 0.1}},
                   "schedule": {"total_steps": "auto"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert main([str(path), "--world-size", "4", "--total-steps", "100"]) == 0
    out, err = capsys.readouterr()
    assert "2 replicas x 2 shards" in out and "multipliers [0.9, 1.1]" in out, out
    assert err.count('value(s) are "auto"') == 1 and "6 value(s)" in err and "optimizer.params.lr" in err, err
    assert "peak LR \"auto\" (optimizer.params.lr): the Trainer's learning_rate" in out, out  # the peak's source
    assert main([str(path), "--world-size", "4"]) == 2  # the flag that stands for max_steps is named
    assert "pass --total-steps N" in capsys.readouterr().err
    ds["hdet"]["replicas"] = 3  # a real error is still one
    path.write_text(json.dumps(ds))
    assert main([str(path), "--world-size", "4", "--total-steps", "100"]) == 2
    assert "hdet.replicas" in capsys.readouterr().err
    # a weight_decay axis over weight_decay "auto", refused as a weight_decay of 0, names the
    # Trainer's value, which alone decides
    ds["hdet"]["replicas"] = 2
    ds["hdet"]["axes"]["weight_decay"] = {"spread_ratio": 0.2}
    path.write_text(json.dumps(ds))
    assert main([str(path), "--world-size", "4", "--total-steps", "100"]) == 2
    err = capsys.readouterr().err
    assert "a multiplicative spread of a weight_decay of 0" in err and (
        'optimizer.params.weight_decay is "auto" in the file: checked with the optimizer\'s default 0 here; '
        "HDETTrainer takes TrainingArguments.weight_decay") in err, err
    assert "optimizer.params.lr is" not in err
    # bf16.enabled "auto" is the Trainer's bf16 argument, not false (--precision bf16 does
    # not "differ from the file"): either precision is costed
    del ds["hdet"]["axes"]["weight_decay"]
    path.write_text(json.dumps(ds))
    for precision, words in (("bf16", "bf16 with fp32 masters"), ("fp32", "fp32")):
        assert main([str(path), "--world-size", "4", "--total-steps", "100", "--params", "1e9",
                     "--precision", precision]) == 0, capsys.readouterr().err
        assert f"(--params), {words}, deepspeed" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["fsdp2", "ddp", "fairscale"])
def test_an_optimizer_block_that_means_another_optimizer_on_a_torch_engine_is_noted(backend):
    """One JSON that means a different optimizer per backend gets a note: DeepSpeed's
    Adam decays weights decoupled (AdamW), torch.optim.Adam as L2; a weight_decay left
    out is 0 in DeepSpeed's AdamW and 0.01 in torch's."""
    from hdet_scale.engine_config import engine_notes

    adam = {"optimizer": {"type": "adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    assert any(n.startswith("deepspeed.optimizer.type=Adam with weight_decay=0.1: the " + backend) and
               "write AdamW" in n for n in engine_notes(adam, backend)), engine_notes(adam, backend)
    bare = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert any("weight_decay is not set" in n and "0.01" in n for n in engine_notes(bare, backend))
    same = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    assert engine_notes(same, backend) == [] and engine_notes(adam, "deepspeed") == []


def test_a_hugging_face_model_config_is_named_as_one(tmp_path, capsys):
    """A model's ``config.json`` given where the DeepSpeed JSON belongs is one line
    naming the model type and where the file goes (hdet-dryrun: ``--hf-config``;
    hdet-train: ``deepspeed_config`` holds DeepSpeed's keys, the model is ``model.*``),
    not 23 "unknown DeepSpeed key" lines, each listing DeepSpeed's 60 keys. A DeepSpeed
    JSON holding a stray ``model_type`` is not taken for one."""
    transformers = pytest.importorskip("transformers")
    from hdet_scale.train.config_files import load_deepspeed_json

    path = tmp_path / "config.json"
    transformers.LlamaConfig(num_hidden_layers=2).to_json_file(str(path))
    assert main([str(path), "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hdet-dryrun: error: {str(path)!r} is a Hugging Face model config (model_type 'llama'), not a "
                   f"DeepSpeed config: give it as --hf-config {path} (the cost model), and the DeepSpeed JSON with "
                   "the hdet block as the first argument"), err
    with pytest.raises(HDETConfigError, match=r"^deepspeed_config: file .* is a Hugging Face model config "
                                              r"\(model_type 'llama'\), not a DeepSpeed config; hdet-train's model"):
        load_deepspeed_json(str(path))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**ZERO3, "model_type": "llama"}))
    assert load_deepspeed_json(str(ds))["model_type"] == "llama"  # a DeepSpeed JSON: its keys are checked later
    assert main([str(ds), "--world-size", "4"]) == 2
    assert "model_type: unknown DeepSpeed key" in capsys.readouterr().err


@pytest.mark.parametrize("schedule,source", [
    ({"name": "onecycle", "total_steps": 1000}, "optimizer.params.lr"),
    ({"name": "onecycle", "total_steps": 1000, "max_lr": 2e-3, "pct_start": 0.25}, "hdet.schedule.max_lr"),
    ({"name": "cosine", "total_steps": 1000, "warmup_steps": 100}, "optimizer.params.lr"),
])
def test_the_schedule_line_gives_the_peak_lr_and_its_source(schedule, source):
    """The report says which peak LR a run starts from, and where it comes from. The LRs
    printed are held to torch's OneCycleLR (onecycle) and to the nanoGPT formulas (cosine).

    Steps are numbered as in hdet-train's metrics.jsonl (and the report's sync steps):
    from 1, the record ``"step": s`` holding the LR the s-th optimizer step used, i.e.
    torch's scheduler value before its (s-1)-th ``step()`` call: no "at step 0" or "the
    last step (999)" (0-based) next to syncs numbered from 1."""
    import math
    import re

    import torch

    text = describe({**ZERO3, "hdet": {**BLOCK, "schedule": schedule}}, world_size=8)
    line = next(line for line in text.splitlines() if line.startswith("schedule "))
    found = re.search(r"LR (\S+) at step (\d+) \(the first\), peak (\S+) at step (\d+), (\S+) at the last step "
                      rf"\((\d+)\) \(peak from {re.escape(source)}\)", line)
    assert found, line
    first_step, last_step, top_step = int(found[2]), int(found[6]), int(found[4])
    assert (first_step, last_step) == (1, 1000)
    printed = {first_step: float(found[1]), top_step: float(found[3]), last_step: float(found[5])}
    peak = schedule.get("max_lr", 1e-3)
    if schedule["name"] == "onecycle":
        opt = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak, total_steps=1000,
                                                    pct_start=schedule.get("pct_start", 0.3), cycle_momentum=False)
        metrics = {}  # what metrics.jsonl records: "step": s -> the LR optimizer step s used
        for s in range(1, 1001):
            metrics[s] = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
    else:  # linear warm-up to the peak at step warmup, half cosine to peak * min_ratio (0.1)
        metrics = {s: peak * s / 100 if s <= 100 else
                   peak * 0.1 + (peak - peak * 0.1) / 2 * (math.cos(math.pi * (s - 101) / 900) + 1)
                   for s in range(1, 1001)}
    first_peak = min(s for s, lr in metrics.items() if lr == pytest.approx(max(metrics.values()), rel=1e-12))
    assert top_step == first_peak, (line, first_peak)
    assert printed == pytest.approx({s: metrics[s] for s in printed}, rel=1e-3)  # printed to 4 significant digits


@pytest.mark.parametrize("total,interval,warmup,auto,in_run,held", [
    (10, 5, 5, {"decay_moves": "both"}, 1, False),  # syncs at 5 and 10, only step 5's acts in the run
    (10, 5, 5, {}, 1, False),
    (1000, 100, 0, {"decay_moves": "both"}, 9, False),
    (1000, 100, 0, {"decay_moves": "hold"}, 9, False),
    (1000, 100, 500, {}, 5, False),
    (1001, 100, 500, {}, 6, False),  # the sync at 1000 precedes the last step (1001)
    (1000, 100, 0, {"momentum": 0.0, "step_size": 0.1}, 9, False),  # no momentum: step_size per update
    (1000, 100, 0, {"momentum": 0.9, "step_size": 0.5}, 9, False),
    (1000, 100, 0, {"max_factor": 2.0}, 9, True),  # the ramp would reach x6.4: clipped at x2
    (1000, 10, 0, {"max_factor": 3.0, "momentum": 0.99}, 99, True),
])
def test_log_reach_is_the_log_update_recurrence_with_g_plus_one(total, interval, warmup, auto, in_run, held):
    """The "log" controller's reach is not exp(n x step_size), which would count a
    meta-update at the last step (it changes no step of the run) and ignore the
    velocity, which starts at 0 and ramps up as 1 - beta^k. The hypergradient is in [-1,
    1] (controller.normalized_hypergradient), so the worst case is g = +1 at every
    update before the last step: run controller.log_update that many times and
    compare."""
    import math
    import re

    from hdet_scale.controller import log_update

    block = {**BLOCK, "replicas": 2, "sync_interval": interval, "axes": {"lr": {"spread_ratio": 0.1}},
             "schedule": {"name": "onecycle", "total_steps": total},
             "auto": {"enabled": True, "warmup_steps": warmup, **auto}}
    text = describe({**ZERO3, "hdet": block}, world_size=2)
    found = re.search(r"the multiplier can reach at most x(\S+) / x(\S+) of the schedule within the run "
                      r"\(over the (\d+) meta-updates? before the last step, with momentum (\S+); (held at|bound) "
                      r"max_factor (\S+)\)", text)
    assert found, text
    momentum, step_size = float(found[4]), 0.25 if "step_size" not in auto else auto["step_size"]
    max_factor = auto.get("max_factor", 100.0)
    assert (int(found[3]), found[5] == "held at", float(found[6])) == (in_run, held, max_factor)
    assert momentum == auto.get("momentum", 0.5)
    # the meta-updates hdet-train runs: syncs s (1-based steps) at or after warm-up, s <= total
    syncs = [s for s in range(interval, total + 1, interval) if s >= warmup]
    assert len([s for s in syncs if s < total]) == in_run
    # auto.decay_moves: a sync whose interval OneCycle fell over (torch's own OneCycleLR,
    # the schedule's defaults pct_start 0.3, div 25, final_div 1e4) cannot lower the
    # multiplier ("up", the default) or move it at all ("hold")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=total, pct_start=0.3)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    mode = auto.get("decay_moves", "up")
    free = len([s for s in syncs if s < total and not lrs[s - 1] < lrs[s - interval]])
    free = in_run if mode == "both" else free

    def reach(n):
        log_m = velocity = 0.0
        for _ in range(n):
            log_m, velocity = log_update(log_m, velocity, 1.0, momentum, step_size, max_factor)
        return log_m

    log_m = reach(in_run)
    assert float(found[1]) == float(f"{math.exp(reach(free) if mode == 'hold' else log_m):.3g}")
    assert float(found[2]) == float(f"{math.exp(-reach(free)):.3g}")
    assert ((reach(free) if mode == "hold" else log_m) == math.log(max_factor)) == held
    if free < in_run:
        what = ("only rises", "lower") if mode == "up" else ("does not move", "move")
        assert text.count(f"); during the schedule's decay it {what[0]} (auto.decay_moves {mode}): {free} "
                          f"meta-update{'s' if free != 1 else ''} can {what[1]} it") == 1, text
    else:
        assert "auto.decay_moves" not in text, text


def test_log_reach_with_no_meta_update_before_the_last_step():
    """The only meta-update at the last step moves nothing in the run: x1, said so."""
    block = {**BLOCK, "replicas": 2, "sync_interval": 10, "schedule": {"name": "onecycle", "total_steps": 10},
             "auto": {"enabled": True, "warmup_steps": 0}}
    text = describe({**ZERO3, "hdet": block}, world_size=2)
    assert "1 meta-update (first at step 10)" in text
    assert ("the multiplier stays x1 of the schedule within the run: no meta-update before the last step (one at "
            "the last step changes no step)") in text


def test_a_file_without_a_peak_lr_says_the_optimizers_default_is_used():
    cfg = {**ZERO3, "optimizer": {"type": "AdamW", "params": {}}}
    assert "schedule onecycle: peak LR is the optimizer's default (no optimizer.params.lr in the file)" \
        in describe(cfg, world_size=8)
