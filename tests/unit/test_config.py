"""Unit tests for hdet_scale.config (HDETConfig.from_dict validation) and the pure
layout arithmetic of hdet_scale.topology.Layout."""

from __future__ import annotations

import copy

import pytest

from hdet_scale.config import AxisConfig, HDETConfig
from hdet_scale.errors import HDETConfigError
from hdet_scale.topology import Layout

VALID = {
    "enabled": True,
    "replicas": 4,
    "sync_interval": 100,
    "gradient_sharing": "replica",
    "seed": 1234,
    "bucket_mb": 50,
    "axes": {
        "lr": {"spread_ratio": 1 / 9},
        "weight_decay": {"spread_ratio": 0.05, "kind": "additive", "groups": [0]},
    },
    "schedule": {"name": "onecycle", "total_steps": 5000, "max_lr": [3e-4, 1e-4], "pct_start": 0.25,
                 "anneal_strategy": "linear", "div_factor": 10, "final_div_factor": 1000.0,
                 "three_phase": True, "cycle_momentum": True},
    "auto": {"enabled": True, "warmup_steps": 1000, "temperature": 0.002, "momentum": 0.9,
             "step_size": 0.5, "decay": "auto"},
    "logging": {"jsonl": "/tmp/m.jsonl", "every": 10, "wandb": {"enabled": False, "mode": "offline"}},
}


def _bad(**patch) -> dict:
    """VALID with nested keys replaced: _bad(**{"auto.decay": 1.0})."""
    d = copy.deepcopy(VALID)
    for dotted, value in patch.items():
        node = d
        *path, last = dotted.split(".")
        for k in path:
            node = node[k]
        node[last] = value
    return d


def _error(data: dict) -> str:
    with pytest.raises(HDETConfigError) as e:
        HDETConfig.from_dict(data)
    return str(e.value)


def test_valid_block_parses():
    cfg = HDETConfig.from_dict(VALID)
    assert cfg.replicas == 4 and cfg.sync_interval == 100 and cfg.gradient_sharing == "replica"
    assert cfg.seed == 1234
    assert cfg.bucket_mb == 50.0 and isinstance(cfg.bucket_mb, float)
    assert set(cfg.axes) == {"lr", "weight_decay"}
    assert isinstance(cfg.axes["lr"], AxisConfig)
    assert cfg.axes["lr"].spread_ratio == 1 / 9 and cfg.axes["lr"].kind == "multiplicative"
    assert cfg.axes["weight_decay"].kind == "additive" and cfg.axes["weight_decay"].groups == [0]
    assert cfg.axis_auto("lr") is True and cfg.axis_auto("weight_decay") is False
    s = cfg.schedule
    assert (s.name, s.total_steps, s.max_lr, s.pct_start) == ("onecycle", 5000, [3e-4, 1e-4], 0.25)
    assert s.div_factor == 10.0 and isinstance(s.div_factor, float)
    assert s.three_phase is True and s.cycle_momentum is True and s.anneal_strategy == "linear"
    a = cfg.auto
    assert (a.enabled, a.warmup_steps, a.temperature, a.momentum, a.step_size, a.decay) == \
        (True, 1000, 0.002, 0.9, 0.5, "auto")
    assert cfg.logging.every == 10 and cfg.logging.wandb.mode == "offline"
    # round trip
    assert HDETConfig.from_dict(cfg.to_dict()) == cfg


def test_minimal_block_defaults():
    cfg = HDETConfig.from_dict({"schedule": {"total_steps": 10}})
    assert cfg.replicas == 1 and cfg.sync_interval == 1000 and cfg.gradient_sharing == "global"
    assert set(cfg.axes) == {"lr"} and cfg.axes["lr"].spread_ratio == 0.0
    assert cfg.auto.enabled is False and cfg.auto.decay == "auto"
    # the redesigned controller: log-space multiplier, probe fitness, tied groups; the
    # tunables are None = the controller's default (CONTROLLER_DEFAULTS)
    a = cfg.auto
    assert (a.controller, a.fitness, a.groups, a.max_factor) == ("log", "probe", "tied", 100.0)
    assert (a.temperature, a.momentum, a.step_size) == (None, None, None)
    assert (a.resolved("temperature"), a.resolved("momentum"), a.resolved("step_size")) == ("auto", 0.5, 0.25)
    assert (cfg.warm_init.enabled, cfg.warm_init.nu, cfg.warm_init.seed) == (False, 0.01, 0)


def test_missing_total_steps_is_reported():
    msg = _error({})
    assert "hdet.schedule.total_steps" in msg and ">= 1" in msg


@pytest.mark.parametrize("ratio", [1.0, 1.5, 9.0])
def test_spread_ratio_at_least_one_on_multiplicative_axis(ratio):
    msg = _error(_bad(**{"axes.lr.spread_ratio": ratio}))
    assert "hdet.axes.lr.spread_ratio" in msg
    assert "[0, 1)" in msg


def test_spread_ratio_on_additive_axis_may_exceed_one_but_not_be_negative():
    HDETConfig.from_dict(_bad(**{"axes.weight_decay.spread_ratio": 1.5}))
    msg = _error(_bad(**{"axes.weight_decay.spread_ratio": -0.1}))
    assert "hdet.axes.weight_decay.spread_ratio" in msg and ">= 0" in msg


def test_multiplicative_weight_decay_spread_ratio_above_one_rejected():
    msg = _error(_bad(**{"axes.weight_decay": {"spread_ratio": 1.0}}))
    assert "hdet.axes.weight_decay.spread_ratio" in msg


@pytest.mark.parametrize("t", [0, -5])
def test_sync_interval_not_positive(t):
    msg = _error(_bad(sync_interval=t))
    assert "hdet.sync_interval" in msg and ">= 1" in msg and str(t) in msg


def test_unknown_top_level_key_lists_valid_keys():
    msg = _error(_bad(sync_every=10))
    assert "hdet.sync_every" in msg and "unknown key" in msg
    for k in ("enabled", "replicas", "sync_interval", "gradient_sharing", "seed", "bucket_mb", "axes",
              "schedule", "auto", "warm_init", "logging"):
        assert k in msg.split("valid keys:")[1]


def test_unknown_nested_key():
    msg = _error(_bad(**{"schedule.warmup": 3}))
    assert "hdet.schedule.warmup" in msg and "valid keys" in msg and "warmup_steps" in msg


def test_unknown_axis_name():
    msg = _error(_bad(**{"axes.dropuot": {"spread_ratio": 0.1}}))
    assert "hdet.axes.dropuot" in msg and "unknown axis" in msg
    for name in ("lr", "weight_decay", "beta2", "eps", "dropout", "temperature", "label_smoothing"):
        assert name in msg


def test_unknown_key_inside_axis():
    msg = _error(_bad(**{"axes.lr.spread": 0.1}))
    assert "hdet.axes.lr.spread" in msg and "spread_ratio" in msg


@pytest.mark.parametrize("warm", [5000, 6000])
def test_auto_warmup_not_shorter_than_run(warm):
    msg = _error(_bad(**{"auto.warmup_steps": warm}))
    assert "hdet.auto.warmup_steps" in msg and "total_steps" in msg and "5000" in msg


def test_auto_warmup_leaving_no_sync():
    # Syncs every 300 steps: 4800 is the last before total_steps 5000; a warm-up of 4850
    # would first meta-update at 5100.
    msg = _error(_bad(**{"auto.warmup_steps": 4850, "sync_interval": 300}))
    assert "hdet.auto.warmup_steps" in msg and "no sync" in msg and "step 5100" in msg
    # Every 100 steps, a warm-up of 4950 still meets the sync at step 5000.
    HDETConfig.from_dict(_bad(**{"auto.warmup_steps": 4950}))


def test_auto_warmup_ignored_when_auto_disabled():
    HDETConfig.from_dict(_bad(**{"auto.warmup_steps": 9000, "auto.enabled": False}))


@pytest.mark.parametrize("decay", [1.0, 1.5, -0.01])
def test_auto_decay_outside_unit_interval(decay):
    msg = _error(_bad(**{"auto.decay": decay}))
    assert "hdet.auto.decay" in msg and "[0, 1)" in msg


def test_auto_decay_bad_string():
    msg = _error(_bad(**{"auto.decay": "fast"}))
    assert "hdet.auto.decay" in msg and "'auto'" in msg


def test_auto_decay_explicit_float_ok():
    """An explicit gamma is a setting of the paper controller; 0.0 (no decay) is also
    accepted under the default log controller, which ignores it."""
    assert HDETConfig.from_dict(_bad(**{"auto.decay": 0.0})).auto.decay == 0.0
    cfg = HDETConfig.from_dict(_bad(**{"auto.decay": 0.05, "auto.controller": "paper"}))
    assert cfg.auto.decay == 0.05 and cfg.auto.controller == "paper"


@pytest.mark.parametrize("key,value", [("replicas", "4"), ("sync_interval", "100"), ("replicas", 2.0),
                                       ("replicas", True), ("schedule.total_steps", "5000"),
                                       ("auto.warmup_steps", 10.5)])
def test_wrong_type(key, value):
    msg = _error(_bad(**{key: value}))
    assert f"hdet.{key}: expected" in msg and "int" in msg and repr(value) in msg


def test_wrong_type_for_float_and_bool():
    msg = _error(_bad(**{"auto.temperature": "0.1", "schedule.three_phase": 1}))
    # temperature may be the string "auto", so a numeric string is refused by value
    assert "hdet.auto.temperature: must be a float > 0 (nats), 'auto' or null, got '0.1'" in msg
    assert "hdet.schedule.three_phase: expected bool" in msg


@pytest.mark.parametrize("key,value,allowed", [
    ("gradient_sharing", "all", ["global", "replica"]),
    ("schedule.name", "step", ["onecycle", "cosine", "constant"]),
    ("schedule.anneal_strategy", "exp", ["cos", "linear"]),
    ("axes.lr.kind", "additive", ["multiplicative"]),
    ("axes.weight_decay.kind", "log", ["multiplicative", "additive"]),
    ("logging.wandb.mode", "cloud", ["online", "offline", "disabled"]),
])
def test_enumerated_values_name_key_and_allowed_values(key, value, allowed):
    msg = _error(_bad(**{key: value}))
    assert f"hdet.{key}" in msg
    for a in allowed:
        assert a in msg


@pytest.mark.parametrize("key,value", [("auto.temperature", 0.0), ("auto.momentum", 1.0),
                                       ("auto.step_size", -1.0), ("schedule.pct_start", 1.5),
                                       ("schedule.max_lr", [3e-4, -1.0]), ("schedule.max_lr", 0.0),
                                       ("bucket_mb", 0), ("logging.every", 0), ("replicas", 0),
                                       ("axes.weight_decay.groups", []), ("axes.weight_decay.groups", [-1])])
def test_out_of_range_values(key, value):
    msg = _error(_bad(**{key: value}))
    assert f"hdet.{key}" in msg


def test_cycle_momentum_needs_onecycle():
    msg = _error(_bad(**{"schedule.name": "cosine"}))
    assert "hdet.schedule.cycle_momentum" in msg and "onecycle" in msg


def test_several_errors_reported_in_one_message():
    data = _bad(**{"sync_interval": 0, "axes.lr.spread_ratio": 1.2, "auto.decay": 2.0, "replicas": "x",
                   "bogus": 1, "axes.dropout": {}})
    msg = _error(data)
    for key in ("hdet.sync_interval", "hdet.axes.lr.spread_ratio", "hdet.auto.decay", "hdet.replicas",
                "hdet.bogus", "hdet.axes.dropout"):
        assert key in msg, key
    assert msg.count("\n") >= 6


def test_not_a_mapping():
    assert "hdet: expected an object" in _error([1, 2])
    assert "hdet.axes" in _error(_bad(axes=[1]))


@pytest.mark.parametrize("patch,line", [
    ({"schedule.total_steps": 10.5}, "hdet.schedule.total_steps: expected int | None, got 10.5"),
    ({"schedule.total_steps": "abc"}, "hdet.schedule.total_steps: expected int | None, got 'abc'"),
    ({"schedule": 5}, "hdet.schedule: expected an object, got int 5"),
    ({"schedule": None}, "hdet.schedule: expected an object, got null"),  # JSON's word, not "got NoneType"
    ({"auto.warmup_steps": 1.5}, "hdet.auto.warmup_steps: expected int, got 1.5"),
])
def test_a_wrong_type_is_one_line_not_also_a_verdict_on_the_default(patch, line):
    """A value of the wrong type leaves the field's default in its place, which the range
    checks must not judge too (total_steps 10.5 would give "expected int | None, got 10.5"
    and "must be an integer >= 1, got None"): exactly one line names the key (or its
    block)."""
    msg = _error(_bad(**patch))
    key = line.split(":")[0]
    lines = msg.splitlines()[1:]
    assert [s.strip() for s in lines if s.strip().startswith(key)] == [line], msg


# ---- Layout ------------------------------------------------------------------------------

def test_layout_not_dividing_world_names_key_and_divisors():
    with pytest.raises(HDETConfigError) as e:
        Layout(world_size=6, replicas=4)
    msg = str(e.value)
    assert "hdet.replicas" in msg
    assert "[1, 2, 3, 6]" in msg


def test_layout_divisors_are_those_of_trying_every_count_in_bounded_time():
    """The allowed replica counts named when R does not divide W are found by trial up
    to sqrt(W) (trying every count up to W is O(W): minutes for hdet-dryrun --world-size
    10**10): the same lists as trying every count (W up to 400), 10**12 + 1 = 73 x 137 x
    99990001 in well under the 5 s asserted (load margin), and the rule instead of a
    list above 10**14."""
    import time

    from hdet_scale.topology import _divisors

    for w in range(1, 401):
        assert _divisors(w) == [d for d in range(1, w + 1) if w % d == 0]
    start = time.perf_counter()
    with pytest.raises(HDETConfigError) as e:
        Layout(world_size=10**12 + 1, replicas=2)
    assert time.perf_counter() - start < 5
    assert str(e.value).endswith("[1, 73, 137, 10001, 99990001, 7299270073, 13698630137, 1000000000001]")
    with pytest.raises(HDETConfigError, match=f"allowed values for this world: the divisors of {10**15 + 1}"):
        Layout(world_size=10**15 + 1, replicas=2)


def test_layout_zero_replicas_rejected():
    with pytest.raises(HDETConfigError, match="hdet.replicas"):
        Layout(world_size=8, replicas=0)


def test_layout_rank_out_of_world():
    with pytest.raises(ValueError):
        Layout(8, 2, rank=8)


def test_layout_8_by_2_rank_5():
    lay = Layout(8, 2, rank=5)
    assert lay.shard_size == 4
    assert lay.replica_index == 1
    assert lay.shard_index == 1
    assert lay.replica_group_ranks() == [1, 5]
    assert lay.shard_group_ranks() == [4, 5, 6, 7]
    assert lay.shard_group_ranks(0) == [0, 1, 2, 3]
    assert lay.replica_group_ranks(3) == [3, 7]


@pytest.mark.parametrize("W,R", [(8, 1), (8, 2), (8, 4), (8, 8), (6, 3), (12, 4)])
def test_layout_groups_partition_the_world(W, R):
    S = W // R
    replica_groups, shard_groups = set(), set()
    for rank in range(W):
        lay = Layout(W, R, rank)
        assert lay.shard_size == S
        assert rank == lay.replica_index * S + lay.shard_index
        assert rank in lay.replica_group_ranks() and rank in lay.shard_group_ranks()
        assert len(lay.replica_group_ranks()) == R and len(lay.shard_group_ranks()) == S
        replica_groups.add(tuple(lay.replica_group_ranks()))
        shard_groups.add(tuple(lay.shard_group_ranks()))
    assert sorted(r for g in replica_groups for r in g) == list(range(W))
    assert sorted(r for g in shard_groups for r in g) == list(range(W))
    assert len(replica_groups) == S and len(shard_groups) == R


def test_layout_describe():
    text = Layout(4, 2).describe()
    assert "4 = 2 replicas x 2 shards" in text
    assert "[0, 1]" in text and "[2, 3]" in text and "[0, 2]" in text and "[1, 3]" in text


# ---- degenerate inputs ----

@pytest.mark.parametrize("total,pct", [(10, 0.1), (10, 1.0)])
def test_degenerate_onecycle_phase_rejected_by_config(total, pct):
    with pytest.raises(HDETConfigError, match="hdet.schedule.pct_start"):
        HDETConfig.from_dict({"schedule": {"total_steps": total, "pct_start": pct}})


# ---- the DeepSpeed side: prepare_config (pure, no communication) --------------------------
def _ds(**hdet):
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "hdet": hdet}


def test_prepare_config_without_block_or_disabled_is_plain_deepspeed():
    from hdet_scale.backends.deepspeed import prepare_config

    cfg, ds = prepare_config({"zero_optimization": {"stage": 1}}, world_size=4)
    assert not cfg.enabled and "hdet" not in ds
    cfg, ds = prepare_config({"hdet": {"enabled": False}}, world_size=4)  # no total_steps needed
    assert not cfg.enabled and "hdet" not in ds
    with pytest.raises(HDETConfigError, match="hdet.replica: unknown key"):
        prepare_config({"hdet": {"enabled": False, "replica": 2}}, world_size=4)


def test_prepare_config_divides_global_batch_and_checks_it():
    from hdet_scale.backends.deepspeed import prepare_config

    _, ds = prepare_config({**_ds(replicas=2, schedule={"total_steps": 10}), "train_batch_size": 8}, world_size=4)
    assert ds["train_batch_size"] == 4  # 8 samples over W=4 ranks -> 4 per replica of S=2 ranks
    for tbs, needle in ((12, r"12 is not a multiple of train_micro_batch_size_per_gpu \(2\) x world size \(4\) = 8: "
                             r"DeepSpeed derives gradient_accumulation_steps = 1"), (8.0, "must be an integer")):
        with pytest.raises(HDETConfigError, match=needle):
            prepare_config({**_ds(replicas=2, schedule={"total_steps": 10}), "train_batch_size": tbs}, world_size=4)
    # the accumulation left out is derived as DeepSpeed derives it (16 // 2 // 4 = 2), not taken as 1:
    # 16 is taken, not refused as "must equal 2 x 1 x 4"
    _, ds = prepare_config({**_ds(replicas=2, schedule={"total_steps": 10}), "train_batch_size": 16}, world_size=4)
    assert ds["train_batch_size"] == 8 and "gradient_accumulation_steps" not in ds


@pytest.mark.parametrize("keys,world,message", [
    # refused before any rank (else DeepSpeed's AssertionError "16 != 5 * 3 * 1" in every rank, hdet-dryrun: valid)
    ({"train_batch_size": 32, "gradient_accumulation_steps": 3}, 2,
     "train_batch_size: 32 is not a multiple of gradient_accumulation_steps (3) x world size (2) = 6: DeepSpeed "
     "derives train_micro_batch_size_per_gpu = 5 from it and refuses 5 x 3 x 2 = 30"),
    ({"train_batch_size": 30}, 4, "train_batch_size: 30 is not a multiple of world size (4) = 4: DeepSpeed derives "
                                  "train_micro_batch_size_per_gpu = 7, gradient_accumulation_steps = 1 from it"),
    ({"train_batch_size": 2}, 4, "DeepSpeed derives train_micro_batch_size_per_gpu = 0, gradient_accumulation_steps "
                                 "= 1 from it and refuses 0 x 1 x 4 = 0"),
    ({"train_batch_size": 32}, 4, None), ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, 4, None),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, None),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 7, None),
])
def test_batch_keys_left_out_are_derived_as_deepspeed_derives_them(keys, world, message):
    """``ds_values.batch_errors`` against DeepSpeed's own config class on the same keys:
    each config it refuses is refused here with the line above, each it takes is taken,
    and ``batch_sizes`` gives the micro-batch and accumulation DeepSpeed arrives at (the
    torch engines read them: a file with only train_batch_size is no micro-batch of 1
    there)."""
    deepspeed = pytest.importorskip("deepspeed")
    from hdet_scale.ds_values import batch_errors, batch_sizes

    errors = batch_errors(keys, world_size=world)
    # DeepSpeed's config class on a world of 1 (no process group here), then its own batch
    # derivation and assertion again on ``world`` ranks, from the keys as given
    ds_config = deepspeed.runtime.config.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1})
    ds_config.world_size = world
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        setattr(ds_config, key, keys.get(key))
    try:
        ds_config._configure_train_batch_size()
    except AssertionError:
        ds_config = None
    if message is None:
        assert errors == [] and ds_config is not None, errors
        assert batch_sizes(keys, world) == (ds_config.train_micro_batch_size_per_gpu,
                                            ds_config.gradient_accumulation_steps)
    else:
        assert len(errors) == 1 and message in errors[0] and ds_config is None, errors


def test_infinite_temperature_rejected():
    with pytest.raises(HDETConfigError, match="hdet.auto.temperature"):
        HDETConfig.from_dict({"schedule": {"total_steps": 10}, "auto": {"temperature": float("inf")}})


# ---- the redesigned auto-LR block and warm_init --------------------------------------------

@pytest.mark.parametrize("key,value,allowed", [
    ("auto.controller", "adam", ["log", "paper"]),
    ("auto.fitness", "val_loss", ["probe", "train_loss"]),
    ("auto.groups", "shared", ["tied", "independent"]),
    ("auto.decay_moves", "down", ["up", "both", "hold"]),
])
def test_new_enumerated_auto_keys_name_key_and_allowed_values(key, value, allowed):
    msg = _error(_bad(**{key: value}))
    assert f"hdet.{key}: must be one of" in msg and repr(value) in msg
    for a in allowed:
        assert a in msg


def test_temperature_auto_or_null_accepted_other_strings_refused():
    assert HDETConfig.from_dict(_bad(**{"auto.temperature": "auto"})).auto.temperature == "auto"
    cfg = HDETConfig.from_dict(_bad(**{"auto.temperature": None, "auto.momentum": None, "auto.step_size": None}))
    assert (cfg.auto.resolved("temperature"), cfg.auto.resolved("momentum"), cfg.auto.resolved("step_size")) == \
        ("auto", 0.5, 0.25)  # CONTROLLER_DEFAULTS["log"]
    msg = _error(_bad(**{"auto.temperature": "hot"}))
    assert "hdet.auto.temperature" in msg and "'auto'" in msg and "'hot'" in msg


def test_resolved_takes_the_paper_defaults_and_keeps_explicit_values():
    cfg = HDETConfig.from_dict({"schedule": {"total_steps": 10}, "auto": {"controller": "paper", "momentum": 0.7}})
    a = cfg.auto
    assert (a.resolved("temperature"), a.resolved("momentum"), a.resolved("step_size")) == (0.1, 0.7, 0.5)


@pytest.mark.parametrize("value", [0.5, 0.0, float("inf"), float("nan")])
def test_max_factor_must_be_finite_and_at_least_one(value):
    msg = _error(_bad(**{"auto.max_factor": value}))
    assert "hdet.auto.max_factor" in msg and ">= 1" in msg


def test_max_factor_one_refused_where_it_pins_the_log_multiplier():
    """max_factor 1 under the "log" controller bounds the multiplier to [1, 1], so
    auto-LR would move nothing and say nothing: refused. It stays valid where it pins
    nothing: the "paper" controller (it bounds the floor, min(schedule floor, peak)),
    auto off, or only additive axes under auto."""
    msg = _error(_bad(**{"auto.max_factor": 1}))
    assert "hdet.auto.max_factor: must be > 1 with auto.controller 'log'" in msg and "lr" in msg
    for ok in ({"auto.controller": "paper"}, {"auto.enabled": False}):
        assert HDETConfig.from_dict(_bad(**{"auto.max_factor": 1, **ok})).auto.max_factor == 1.0
    assert HDETConfig.from_dict(_bad(**{"auto.max_factor": 1.001})).auto.max_factor == 1.001


@pytest.mark.parametrize("key,value", [("auto.step_size", float("inf")), ("auto.momentum", -0.1),
                                       ("auto.temperature", float("nan"))])
def test_more_out_of_range_auto_values(key, value):
    assert f"hdet.{key}" in _error(_bad(**{key: value}))


def test_decay_float_with_log_controller_refused():
    msg = _error(_bad(**{"auto.decay": 0.05}))
    assert "hdet.auto.decay" in msg and "controller 'paper'" in msg
    msg = _error(_bad(**{"auto.decay": 0.05, "auto.controller": "log"}))
    assert "hdet.auto.decay" in msg


@pytest.mark.parametrize("value", [-0.01, 1.5, 1e3, float("inf"), float("nan")])
def test_warm_init_nu_must_be_in_unit_interval(value):
    # nu is the noise std relative to the weights' RMS: above 1 the noise swamps the weights.
    msg = _error(_bad(warm_init={"enabled": True, "nu": value}))
    assert "hdet.warm_init.nu" in msg and "[0, 1]" in msg


def test_warm_init_block_parses_and_checks_types_and_keys():
    cfg = HDETConfig.from_dict(_bad(warm_init={"enabled": True, "nu": 0, "seed": 3}))
    assert (cfg.warm_init.enabled, cfg.warm_init.nu, cfg.warm_init.seed) == (True, 0.0, 3)
    assert isinstance(cfg.warm_init.nu, float)
    assert HDETConfig.from_dict(cfg.to_dict()) == cfg
    assert "hdet.warm_init.seed: expected int" in _error(_bad(warm_init={"seed": "1"}))
    msg = _error(_bad(warm_init={"sigma": 0.1}))
    assert "hdet.warm_init.sigma: unknown key" in msg and "nu" in msg


def test_new_auto_keys_round_trip():
    d = _bad(**{"auto.controller": "paper", "auto.fitness": "train_loss", "auto.groups": "independent",
                "auto.max_factor": 10.0, "auto.decay": 0.01})
    cfg = HDETConfig.from_dict(d)
    assert (cfg.auto.controller, cfg.auto.fitness, cfg.auto.groups, cfg.auto.max_factor, cfg.auto.decay) == \
        ("paper", "train_loss", "independent", 10.0, 0.01)
    assert HDETConfig.from_dict(cfg.to_dict()) == cfg


def test_a_list_for_data_path_names_the_comma_separated_form(tmp_path):
    """``data.path=[b.txt,a.txt]`` names the key, the list, and the form
    data.load_corpus reads (one comma-separated string), from an override and from a
    YAML file alike, not "Cannot convert 'ListConfig' to string"."""
    from hdet_scale.train.config import load_run_config

    want = ("data.path: expected one string, got a list ['b.txt', 'a.txt']; give several files or folders as one "
            "comma-separated string: data.path=b.txt,a.txt")
    run = tmp_path / "run.yaml"
    run.write_text("data:\n  path: [b.txt, a.txt]\n")
    for path, overrides in ((None, ["data.path=[b.txt,a.txt]"]), (str(run), [])):
        with pytest.raises(HDETConfigError) as err:
            load_run_config(path, overrides)
        assert str(err.value) == want, str(err.value)
