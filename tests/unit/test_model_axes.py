"""Axes beyond the LR: dropout, temperature and label smoothing (model side), beta2 and
eps (optimizer side), their bounds, and the refusals, in one process (the ``Simulator``
holds R replicas; the backends bind their model through the same ``bind_model``:
test_agreement, test_train_axes).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hdet_scale import Simulator
from hdet_scale.autolr import Controller, build_schedule
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler, LiveParamGroups
from hdet_scale.errors import HDETConfigError


@pytest.fixture(autouse=True)
def _own_working_dir(tmp_path, monkeypatch):
    """hdet-train's default run_dir is relative (runs/default): a run the user made in the
    folder pytest starts from must not change these tests, nor these tests write there."""
    monkeypatch.chdir(tmp_path)


def tiny_llama(dropout: float = 0.1) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                      attention_dropout=dropout, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


class WithDropout(nn.Module):
    """An ``nn.Dropout`` beside the Llama (every dropout is set unless ``modules`` narrows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = tiny_llama()
        self.head_drop = nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head_drop(self.llama(input_ids=ids).logits)


def block(**axes) -> dict:
    return {"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": 0.1}, **axes},
            "schedule": {"name": "constant", "total_steps": 8}, "auto": {"enabled": False}}


def attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]


def run(sim: Simulator, steps: int, check) -> None:
    ids = torch.arange(8).reshape(1, 8)
    for _ in range(steps):
        check()
        sim.step(lambda m, r: m(ids).float().pow(2).mean())
    check()


def test_dropout_reaches_every_dropout_and_attention_module_of_each_replica():
    """Additive spread 0.05 around 0.1: the replicas run 0.05 and 0.15 (in the permutation
    of the interval), and each replica's every ``nn.Dropout.p`` and Llama attention
    ``attention_dropout`` equals its value at every step, through the redraws at syncs."""
    sim = Simulator(WithDropout, lambda p: torch.optim.SGD(p, lr=0.01),
                    block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.1}))
    seen = set()

    def check():
        for r, m in enumerate(sim.models):
            v = sim.scheduler.model_value("dropout", r)
            seen.add(round(v, 12))
            assert m.head_drop.p == v
            assert [a.attention_dropout for a in attentions(m)] == [v, v]
        assert sorted(sim.scheduler.applied[("dropout", 0)]) == pytest.approx([0.05, 0.15], abs=1e-15)

    run(sim, 6, check)
    assert seen == {0.05, 0.15}


@pytest.mark.parametrize("end", ["total_steps", "finish"])
def test_the_run_ends_with_every_replica_at_the_shared_model_axis_value(end):
    """At the end of the run (step ``total_steps``, or ``finish()`` of a run stopped
    before it) every replica's modules hold the base value (0.1, spread 0.05 explored
    around it), so that an evaluation (and anything after the run) does not mix the
    replicas' values, and the end's record names it (no file of the model holds it)."""
    sim = Simulator(WithDropout, lambda p: torch.optim.SGD(p, lr=0.01),
                    block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.1}))
    ids = torch.arange(8).reshape(1, 8)
    steps = 8 if end == "total_steps" else 5
    sim.scheduler.last_step = steps
    for _ in range(steps):
        sim.step(lambda m, r: m(ids).float().pow(2).mean())
    apart = [sim.scheduler.model_value("dropout", r) for r in range(2)]
    record = sim.scheduler.finish() if end == "finish" else sim.scheduler.last_sync
    if end == "finish":
        assert sorted(apart) == pytest.approx([0.05, 0.15], abs=1e-15)  # still the replicas' own before it
    assert record["hdet/dropout/group_0/final"] == pytest.approx(0.1, abs=1e-15), record
    for r, m in enumerate(sim.models):
        assert sim.scheduler.model_value("dropout", r) == pytest.approx(0.1, abs=1e-15)
        assert m.head_drop.p == pytest.approx(0.1, abs=1e-15)
        assert [a.attention_dropout for a in attentions(m)] == [m.head_drop.p] * 2


def test_modules_patterns_narrow_what_dropout_sets():
    """``modules: ["*.self_attn"]`` sets the attention dropout only; the other ``nn.Dropout``
    keeps its own 0.1."""
    sim = Simulator(WithDropout, lambda p: torch.optim.SGD(p, lr=0.01),
                    block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.3,
                                   "modules": ["*.self_attn"]}))
    for r, m in enumerate(sim.models):
        assert m.head_drop.p == 0.1
        assert [a.attention_dropout for a in attentions(m)] == [sim.scheduler.model_value("dropout", r)] * 2
    # a pattern no module name matches says so (and that names carry no "module.")
    with pytest.raises(HDETConfigError, match=r"hdet.axes.dropout.modules: \['module.\*.nothing'\] match no module "
                                              r"name of WithDropout \(names carry no 'module.' prefix\); its names "
                                              r"look like llama, llama.model"):
        Simulator(WithDropout, lambda p: torch.optim.SGD(p, lr=0.01),
                  block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.3,
                                 "modules": ["module.*.nothing"]}))
    with pytest.raises(HDETConfigError, match=r"hdet.axes.dropout: nothing to set .*matching \['\*.embed_tokens'\]"):
        Simulator(WithDropout, lambda p: torch.optim.SGD(p, lr=0.01),
                  block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.3, "modules": ["*.embed_tokens"]}))


def test_temperature_divides_the_attention_logits():
    """Temperature tau on a Llama equals, independently, the same model with its query
    projections scaled by 1 / tau (the logits q.k * scaling are linear in q, RoPE too):
    the forward outputs agree (float32 rounding: atol 1e-5 on logits of size ~0.3)."""
    sim = Simulator(tiny_llama, lambda p: torch.optim.SGD(p, lr=0.01),
                    block(temperature={"spread_ratio": 0.5}))
    ids = torch.arange(8).reshape(1, 8)
    taus = sim.scheduler.applied[("temperature", 0)]
    assert sorted(taus) == pytest.approx([0.5, 1.5])
    for r, m in enumerate(sim.models):
        m.eval()
        ref = copy.deepcopy(m)
        for a in attentions(ref):
            a.scaling = a._hdet_scaling
            with torch.no_grad():
                a.q_proj.weight.div_(taus[r])
        assert [a.scaling for a in attentions(m)] == pytest.approx([8 ** -0.5 / taus[r]] * 2)  # head_dim 8
        with torch.no_grad():
            out, want = m(input_ids=ids).logits, ref(input_ids=ids).logits
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    with torch.no_grad():  # and the two temperatures give different outputs (> 10 x the atol above)
        a, b = (m(input_ids=ids).logits for m in sim.models)
    assert (a - b).abs().max() > 1e-4


def test_label_smoothing_is_read_per_replica():
    sim = Simulator(lambda: nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.01),
                    block(label_smoothing={"spread_ratio": 0.04, "kind": "additive", "value": 0.05}))
    values = [sim.scheduler.model_value("label_smoothing", r) for r in range(2)]
    assert sorted(values) == pytest.approx([0.01, 0.09])
    with pytest.raises(KeyError):
        sim.scheduler.model_value("dropout", 0)


def test_beta2_and_eps_reach_each_replicas_param_groups():
    """beta2 (additive, around Adam's 0.95) goes into ``betas[1]`` with ``betas[0]`` kept;
    eps (multiplicative) into ``eps``; each replica's optimizer holds its value."""
    sim = Simulator(lambda: nn.Linear(2, 2), lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.9, 0.95), eps=1e-8),
                    block(beta2={"spread_ratio": 0.01, "kind": "additive"}, eps={"spread_ratio": 0.5}))
    for r, opt in enumerate(sim.optimizers):
        (g,) = opt.param_groups
        assert g["betas"] == (0.9, sim.scheduler.applied[("beta2", 0)][r])
        assert g["eps"] == sim.scheduler.applied[("eps", 0)][r]
    assert sorted(sim.scheduler.applied[("beta2", 0)]) == pytest.approx([0.94, 0.96])
    assert sorted(sim.scheduler.applied[("eps", 0)]) == pytest.approx([0.5e-8, 1.5e-8])


def test_bounds_hold_the_base_where_every_replica_stays_inside():
    """Dropout, additive spread 0.05, bounds [0, 0.9]: the base never passes 0.85 (the
    top replica 0.9) however far auto pushes it, in either controller."""
    cfg = HDETConfig.from_dict(block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.8,
                                              "auto": True}))
    ctl = Controller(cfg, build_schedule(cfg), [0.01], [("dropout", 0), ("lr", 0)])
    ctl.log_m[("dropout", 0)] = 10.0
    assert ctl.value(("dropout", 0), 0.8) == pytest.approx(0.85)
    ctl.log_m[("dropout", 0)] = -10.0
    assert ctl.value(("dropout", 0), 0.8) == pytest.approx(0.05)
    paper = HDETConfig.from_dict({**block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.8,
                                                   "auto": True}),
                                  "auto": {"enabled": True, "controller": "paper", "decay": 0.0, "step_size": 100.0,
                                           "temperature": 0.01, "fitness": "probe"}})
    ctl = Controller(paper, build_schedule(paper), [0.01], [("dropout", 0)])
    record: dict = {}
    ctl.update([1.0, 2.0], {("dropout", 0): [1, 0]}, {("dropout", 0): [0.85, 0.75]}, lambda k: 0.8, record)
    assert ctl.base[("dropout", 0)] == pytest.approx(0.85) and record["hdet/dropout/group_0/ceiled"] == 1


@pytest.mark.parametrize("axes,needle", [
    ({"dropout": {"spread_ratio": 0.05}}, "hdet.axes.dropout.value: required"),
    ({"dropout": {"spread_ratio": 0.05, "kind": "additive", "value": 0.02}}, "outside bounds [0, 0.9]"),
    ({"dropout": {"value": 0.1, "groups": [0]}}, "hdet.axes.dropout.groups: dropout is a model-side axis"),
    ({"beta2": {"value": 0.9}}, "hdet.axes.beta2.value: beta2 is read from the optimizer"),
    ({"label_smoothing": {"modules": ["*"]}}, "hdet.axes.label_smoothing.modules: only dropout and temperature"),
    ({"temperature": {"bounds": [0, 2]}}, "hdet.axes.temperature.bounds: must be [lo, hi]"),
    ({"dropout": {"value": 0.1, "bounds": [0.0, 1.0]}}, "hdet.axes.dropout.bounds"),
    ({"temperature": {"spread_ratio": 0.5, "value": 0.015}}, "hdet.axes.temperature.value"),
])
def test_bad_axis_blocks_are_refused_naming_the_key(axes, needle):
    with pytest.raises(HDETConfigError) as e:
        HDETConfig.from_dict(block(**axes))
    assert needle in str(e.value)


def test_optimizer_side_bounds_and_missing_keys_are_refused_at_the_scheduler():
    """beta2 0.999 with a multiplicative spread of 0.1 reaches 1.099: refused naming the
    bounds; SGD has no betas: refused naming the key."""
    adam = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=0.01, betas=(0.9, 0.999))
    cfg = HDETConfig.from_dict(block(beta2={"spread_ratio": 0.1}))
    with pytest.raises(HDETConfigError, match=r"hdet.axes.beta2: the optimizer's beta2 0.999 .*outside bounds"):
        HDETScheduler(cfg, LiveParamGroups({0: adam}))
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.01)
    with pytest.raises(HDETConfigError, match=r"hdet.axes.beta2: parameter group 0 has no 'betas'"):
        HDETScheduler(cfg, LiveParamGroups({0: sgd}))


def test_a_model_without_dropout_is_refused_naming_the_axis():
    with pytest.raises(HDETConfigError, match=r"hdet.axes.dropout: nothing to set in Linear: it needs an nn.Dropout"):
        Simulator(lambda: nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.01),
                  block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.1}))


def test_hdet_train_checks_beta2_bounds_from_the_file_before_any_rank_starts():
    """hdet-train and hdet-dryrun read Adam's betas from the DeepSpeed optimizer block (or the
    optimizer's default 0.999) for the bounds check, before the optimizer exists."""
    from hdet_scale.autolr import check_additive_floors
    from hdet_scale.engine_config import axis_bases

    cfg = HDETConfig.from_dict(block(beta2={"spread_ratio": 0.1}))
    for params, beta2 in (({"lr": 1e-3, "betas": [0.9, 0.95]}, 0.95), ({"lr": 1e-3}, 0.999)):
        ds = {"optimizer": {"type": "AdamW", "params": params}}
        assert axis_bases(cfg, ds, "deepspeed")[("beta2", 0)] == beta2
        with pytest.raises(HDETConfigError, match=rf"beta2 {beta2:g} .*outside bounds \[0, 0.99999\]"):
            check_additive_floors(cfg, build_schedule(cfg), axis_bases(cfg, ds, "deepspeed"))
    ok = HDETConfig.from_dict(block(beta2={"spread_ratio": 0.0005, "kind": "additive"}))
    check_additive_floors(ok, build_schedule(ok), axis_bases(ok, {"optimizer": {"type": "AdamW", "params": {}}}, "ddp"))


@pytest.mark.parametrize("axes,needle", [
    ({"lr": {"spread_ratio": 0.1, "bounds": [0.001, 0.01]}}, "hdet.axes.lr.bounds: the lr axis follows hdet.schedule"),
    ({"dropout": {"spread_ratio": 0.05, "value": 0.0}}, "hdet.axes.dropout.kind: a multiplicative spread of a dropout of 0"),
    ({"label_smoothing": {"spread_ratio": 0.05}}, "hdet.axes.label_smoothing.kind: a multiplicative spread"),
    # additive around 0 is no way out for temperature (bounds from 0.01); inf is not "outside bounds"
    ({"temperature": {"spread_ratio": 0.1, "value": 0}}, "nothing is explored: use a temperature > 0"),
    ({"temperature": {"spread_ratio": 0.1, "value": math.inf, "bounds": [0.01, math.inf]}},
     "hdet.axes.temperature.value: must be a finite number, got inf"),
])
def test_round_16_axis_configs_are_refused_when_parsed(axes, needle):
    """Bounds on the LR are checked against the whole schedule, not its peak only (the
    schedule would take the replicas outside them); a multiplicative spread of a
    model-side 0 is refused when the config is parsed, not inside the ranks with the
    optimizer's wording."""
    with pytest.raises(HDETConfigError) as e:
        HDETConfig.from_dict(block(**axes))
    assert needle in str(e.value)
    assert str(e.value).count("\n") == 1  # one line under the header: no second verdict on the same value


def test_a_modules_pattern_that_matches_nothing_is_refused_beside_one_that_matches():
    with pytest.raises(HDETConfigError, match=r"hdet.axes.dropout.modules: '\*.self_atn' matches no module"):
        Simulator(WithDropout, lambda p: torch.optim.SGD(p, lr=0.01),
                  block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.3,
                                 "modules": ["*.self_attn", "*.self_atn"]}))


def test_the_log_controller_holds_the_shift_at_the_bound_and_says_so():
    """Dropout 0.8, additive spread 0.05, bounds [0, 0.9]: a strong push holds the shift at
    +0.05 (base 0.85), logs ``ceiled`` and a multiplier (shift) of 0.05, not one that grows."""
    cfg = HDETConfig.from_dict({**block(dropout={"spread_ratio": 0.05, "kind": "additive", "value": 0.8,
                                                 "auto": True}),
                                "auto": {"enabled": True, "step_size": 10.0, "temperature": 0.01,
                                         "fitness": "probe"}})
    ctl = Controller(cfg, build_schedule(cfg), [0.01], [("dropout", 0)])
    for _ in range(3):
        record: dict = {}
        ctl.update([2.0, 1.0], {("dropout", 0): [0, 1]}, {("dropout", 0): [0.75, 0.85]}, lambda k: 0.8, record,
                   raw=lambda k: 0.8)
        assert record["hdet/dropout/group_0/ceiled"] == 1
        assert record["hdet/dropout/group_0/multiplier"] == pytest.approx(0.05)
    assert ctl.value(("dropout", 0), 0.8) == pytest.approx(0.85)


def test_hdet_train_names_a_list_over_an_object_and_two_dropout_values():
    """A list where the DeepSpeed config has an object is named (no OmegaConf TypeError
    traceback); model.dropout and axes.dropout.value disagreeing is refused, not left
    silent."""
    from hdet_scale.train.config import load_run_config

    with pytest.raises(HDETConfigError, match=r"deepspeed.hdet.axes: expected an object .*got a list"):
        load_run_config(None, ["deepspeed.hdet.axes=[lr, dropout]"])
    with pytest.raises(HDETConfigError, match=r"deepspeed.optimizer.params.betas: expected a list"):
        load_run_config(None, ["deepspeed.optimizer.params.betas={a: 1}"])
    for model_dropout in ("0.1", "0.0"):  # an explicit 0.0 (the default) counts too: not silently overridden
        with pytest.raises(HDETConfigError, match=rf"axes.dropout.value=0.2 and model.dropout={model_dropout}: in "
                                                  "hdet-train the dropout axis spreads around model.dropout"):
            load_run_config(None, [f"model.dropout={model_dropout}",
                                   "deepspeed.hdet.axes={dropout: {spread_ratio: 0.05, kind: additive, value: 0.2}}"])
    run = load_run_config(None, ["model.dropout=0.1", "deepspeed.hdet.axes={dropout: {spread_ratio: 0.05, kind: additive}}"])
    assert run["deepspeed"]["hdet"]["axes"]["dropout"]["value"] == 0.1


def test_beta2_or_eps_on_an_optimizer_without_them_is_refused_from_the_file():
    """hdet-dryrun and hdet-train both refuse a beta2 axis on SGD from the optimizer block,
    before any rank starts (inside the ranks the refusal would come 16-26 s in)."""
    from hdet_scale.dryrun import describe
    from hdet_scale.engine_config import check_optimizer_axes

    cfg = HDETConfig.from_dict(block(beta2={"spread_ratio": 0.001}, eps={"spread_ratio": 0.5}))
    with pytest.raises(HDETConfigError, match=r"deepspeed.hdet.axes.beta2: the optimizer SGD has no betas"):
        check_optimizer_axes(cfg, {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    eps_only = HDETConfig.from_dict(block(eps={"spread_ratio": 0.5}))
    check_optimizer_axes(eps_only, {"optimizer": {"type": "Adagrad"}})  # Adagrad has eps
    check_optimizer_axes(cfg, {"optimizer": {"type": "AdamW"}})
    check_optimizer_axes(cfg, {"optimizer": {"type": "SomethingNew"}})  # unknown: the engine checks it
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
              "hdet": {**block(beta2={"spread_ratio": 0.001}), "schedule": {"total_steps": 100}}}
    with pytest.raises(HDETConfigError, match=r"hdet.axes.beta2: the optimizer SGD has no betas"):
        describe(config, world_size=2, backend="ddp")


def test_hdet_train_checks_modules_on_its_model_before_any_rank_starts():
    """A dropout / temperature ``modules`` pattern matching nothing is refused before
    the ranks start (after them it would take up to 29 s on DDP): validate checks it on
    the meta model, with the library's message under the trainer's key."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run = load_run_config(None, ["backend=ddp", "wandb.enabled=false",
                                 'deepspeed.hdet.axes={lr: {spread_ratio: 0.1}, temperature: {spread_ratio: 0.1, '
                                 'modules: ["nomatch.*"]}}'])
    with pytest.raises(HDETConfigError, match=r"^deepspeed.hdet.axes.temperature.modules: \['nomatch.\*'\] match no "
                                              r"module name of LlamaForCausalLM"):
        validate(run, 4, build_model=False)
    ok = load_run_config(None, ["backend=ddp", "wandb.enabled=false",
                                'deepspeed.hdet.axes={lr: {spread_ratio: 0.1}, temperature: {spread_ratio: 0.1, '
                                'modules: ["model.layers.*.self_attn"]}}'])
    validate(ok, 4, build_model=False)


def test_an_axis_asked_to_move_without_a_spread_warns_while_others_move():
    cfg = HDETConfig.from_dict({**block(temperature={"spread_ratio": 0.0, "auto": True}),
                                "auto": {"enabled": True, "warmup_steps": 2, "fitness": "train_loss"}})
    assert cfg.auto_without_spread_warning.startswith("hdet.axes.temperature: auto is true but spread_ratio is 0")
    quiet = HDETConfig.from_dict({**block(temperature={"spread_ratio": 0.0}),
                                  "auto": {"enabled": True, "warmup_steps": 2, "fitness": "train_loss"}})
    assert quiet.auto_without_spread_warning is None  # not asked to move: a fixed value is a setting


def test_hdet_train_names_model_dropout_the_value_type_and_switches_optimizer_type():
    """hdet-train (1) names a dropout spread leaving its bounds as ``model.dropout``, not as
    ``deepspeed.hdet.axes.dropout.value``, a key hdet-train fills from model.dropout; (2)
    refuses ``value: "0.1"`` (a string) by its type, not as "two base values" with
    equal-looking numbers; (3) takes ``deepspeed.optimizer.type=SGD``, leaving out the
    packaged AdamW's betas / eps with a note."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    spread = "deepspeed.hdet.axes={lr: {spread_ratio: 0.1}, dropout: {spread_ratio: 0.1, kind: additive}}"
    run = load_run_config(None, ["backend=ddp", "wandb.enabled=false", "model.dropout=0.05", spread])
    with pytest.raises(HDETConfigError, match=r"model.dropout \(the base of deepspeed.hdet.axes.dropout in "
                                              r"hdet-train\): 0.05 with spread_ratio 0.1 \(additive\)"):
        validate(run, 4, build_model=False)
    typed = load_run_config(None, ["backend=ddp", "wandb.enabled=false", "model.dropout=0.05",
                                   'deepspeed.hdet.axes={dropout: {spread_ratio: 0.01, kind: additive, value: "0.05"}}'])
    with pytest.raises(HDETConfigError, match=r"deepspeed.hdet.axes.dropout.value: expected float \| None, got '0.05'"):
        validate(typed, 4, build_model=False)
    sgd = load_run_config(None, ["deepspeed.optimizer.type=SGD", "deepspeed.optimizer.params.momentum=0.9"])
    assert sgd["deepspeed"]["optimizer"]["params"] == {"lr": 0.0025, "weight_decay": 0.1, "momentum": 0.9}
    # the same type in other letters: nothing dropped
    adam = load_run_config(None, ["deepspeed.optimizer.type=adamwschedulefree"])
    assert set(adam["deepspeed"]["optimizer"]["params"]) == {"lr", "betas", "eps", "weight_decay", "warmup_steps"}
    given = load_run_config(None, ["deepspeed.optimizer.type=SGD", "deepspeed.optimizer.params.eps=1e-8"])
    with pytest.raises(HDETConfigError, match=r"deepspeed.optimizer.params.eps: not an argument of torch.SGD"):
        validate(given, 4, build_model=False)  # a key the user set next to the type is theirs: still refused
    from hdet_scale.train.start_notes import switch_notes as _switch_notes

    assert _switch_notes(sgd) == ["deepspeed.optimizer.type=SGD replaces the packaged deepspeed.json's "
                                  "AdamWScheduleFree: its optimizer.params betas, eps, warmup_steps are not SGD's and "
                                  "are left out (lr, weight_decay kept)"]
    assert _switch_notes(adam) == []


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "fairscale"])
@pytest.mark.parametrize("spelling", ["sgd", "Sgd"])
def test_a_torch_engine_switches_to_sgd_in_any_letters(backend, spelling):
    """The torch engines take ``optimizer.type`` in any case (docs/config.md): ``sgd`` gives
    the same run config as ``SGD`` (the packaged AdamW's betas / eps left out, not refused with
    "['betas', 'eps'] are not arguments of torch.optim.SGD"), with the same note; DeepSpeed,
    which looks a torch.optim class up by its exact name, refuses ``sgd`` and says to write
    'SGD'."""
    from hdet_scale.train.start_notes import switch_notes as _switch_notes
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run = load_run_config(None, [f"backend={backend}", "wandb.enabled=false", f"deepspeed.optimizer.type={spelling}"])
    upper = load_run_config(None, [f"backend={backend}", "wandb.enabled=false", "deepspeed.optimizer.type=SGD"])
    assert run["deepspeed"]["optimizer"]["params"] == upper["deepspeed"]["optimizer"]["params"] == {
        "lr": 0.0025, "weight_decay": 0.1}
    validate(run, 4, build_model=False)
    assert _switch_notes(run) == [f"deepspeed.optimizer.type={spelling} replaces the packaged deepspeed.json's "
                                  f"AdamWScheduleFree: its optimizer.params betas, eps, warmup_steps are not "
                                  f"{spelling}'s and are left out (lr, weight_decay kept)"]
    ds = load_run_config(None, ["backend=deepspeed", "wandb.enabled=false", f"deepspeed.optimizer.type={spelling}"])
    with pytest.raises(HDETConfigError, match=rf"deepspeed.optimizer.type: '{spelling}' is neither a DeepSpeed "
                                              r"optimizer .* nor a torch.optim class; DeepSpeed looks torch.optim "
                                              r"classes up by their exact name: write 'SGD'"):
        validate(ds, 4, build_model=False)


def test_a_misspelt_optimizer_on_deepspeed_is_one_line_with_the_near_name():
    """``"AdamWW"`` on DeepSpeed is one line, naming the near torch.optim class, without
    ZeRO's untested-optimizer advice (set zero_allow_untested_optimizer), which would
    then fail with the first; a real but untested optimizer (SGD) still gets ZeRO's
    line."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    ds = load_run_config(None, ["backend=deepspeed", "wandb.enabled=false", "deepspeed.optimizer.type=AdamWW"])
    with pytest.raises(HDETConfigError) as e:
        validate(ds, 4, build_model=False)
    assert "'AdamWW' is neither a DeepSpeed optimizer" in str(e.value) and "did you mean 'AdamW'?" in str(e.value)
    assert "zero_allow_untested_optimizer" not in str(e.value), e.value
    sgd = load_run_config(None, ["backend=deepspeed", "wandb.enabled=false", "deepspeed.optimizer.type=SGD"])
    with pytest.raises(HDETConfigError, match="unless zero_allow_untested_optimizer is true"):
        validate(sgd, 4, build_model=False)


def test_an_eps_of_0_spread_multiplicatively_is_refused_in_english():
    """The refusal says "an eps", not "a eps"."""
    from hdet_scale.autolr import build_schedule, check_additive_floors

    cfg = HDETConfig.from_dict(block(eps={"spread_ratio": 0.5}))
    with pytest.raises(HDETConfigError, match=r"hdet.axes.eps: a multiplicative spread of an eps of 0 gives every "
                                              r"replica 0, so nothing is explored: set an eps > 0"):
        check_additive_floors(cfg, build_schedule(cfg), {("lr", 0): 0.01, ("eps", 0): 0.0})


def test_auto_without_a_signal_names_the_axes_that_still_spread():
    """With lr and temperature at spread 0 (auto on) beside a dropout spread, the
    warning names the axis that still spreads, not "the replicas train with the same
    values" (said only where nothing spreads)."""
    cfg = HDETConfig.from_dict({**block(lr={"spread_ratio": 0.0}, temperature={"spread_ratio": 0.0, "auto": True},
                                        dropout={"spread_ratio": 0.1, "kind": "additive", "value": 0.2}),
                                "auto": {"enabled": True, "warmup_steps": 2}})
    text = cfg.auto_without_spread_warning
    assert "the replicas differ only in dropout, which auto-LR does not move" in text, text
    assert "To keep exploring only those, set hdet.auto.enabled=false" in text, text
    alone = HDETConfig.from_dict({**block(lr={"spread_ratio": 0.0}), "auto": {"enabled": True, "warmup_steps": 2}})
    assert "the replicas train with the same values" in alone.auto_without_spread_warning


@pytest.mark.parametrize("axis", ["dropout", "label_smoothing"])
def test_auto_on_a_regulariser_axis_needs_the_probe(axis):
    """An auto ``label_smoothing`` / dropout axis on fitness ``train_loss`` is refused:
    the training loss carries each replica's own smoothing (dropout: is measured with
    dropout on), so less always scores better (label_smoothing falls at every sync,
    hypergradient -0.76 each time, measured). The probe (dropout off, no smoothing) and
    auto false are accepted."""
    spec = {"spread_ratio": 0.05, "kind": "additive", "value": 0.1, "auto": True}
    with pytest.raises(HDETConfigError, match=rf"hdet.axes.{axis}.auto: auto-LR cannot move {axis} on fitness "
                                              "'train_loss'"):
        HDETConfig.from_dict({**block(**{axis: spec}), "auto": {"enabled": True, "fitness": "train_loss"}})
    HDETConfig.from_dict({**block(**{axis: spec}), "auto": {"enabled": True, "fitness": "probe"}})
    HDETConfig.from_dict({**block(**{axis: {**spec, "auto": False}}), "auto": {"enabled": True, "fitness": "train_loss"}})


def test_optimizer_axis_errors_come_with_the_blocks_other_errors():
    """The beta2 bounds / additive eps below 0 / SGD without eps are reported together
    with every other error of the block (a warm-up too long, 3 replicas on 4 ranks), not
    only once those are fixed, in hdet-train and hdet-dryrun."""
    from hdet_scale.dryrun import describe
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run = load_run_config(None, ["backend=ddp", "wandb.enabled=false", "train.steps=20",
                                 "deepspeed.hdet.axes={lr: {spread_ratio: 0.1}, beta2: {spread_ratio: 0.5}}"])
    with pytest.raises(HDETConfigError) as e:
        validate(run, 4, build_model=False)
    lines = str(e.value).splitlines()
    assert lines[1].strip().startswith("deepspeed.hdet.auto.warmup_steps: must be shorter than the run"), lines
    assert lines[2].strip().startswith("deepspeed.hdet.axes.beta2: the optimizer's beta2 0.95 (parameter group 0) "
                                       "with spread_ratio 0.5"), lines
    sgd = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "hdet": {"replicas": 3, "axes": {"lr": {"spread_ratio": 0.1}, "eps": {"spread_ratio": 0.1}},
                    "schedule": {"total_steps": 100}}}
    with pytest.raises(HDETConfigError) as e:
        describe(sgd, world_size=4, backend="ddp")
    assert "hdet.replicas: 3 replicas do not divide the world of 4 ranks" in str(e.value), str(e.value)
    assert "hdet.axes.eps: the optimizer SGD has no eps" in str(e.value), str(e.value)
    with pytest.raises(HDETConfigError) as e:  # beside a --total-steps mismatch too
        describe(sgd | {"hdet": {**sgd["hdet"], "replicas": 2}}, world_size=4, total_steps=1000, backend="ddp")
    assert str(e.value).splitlines()[1:] == ["  --total-steps 1000 is longer than hdet.schedule.total_steps=100 in the "
                                             "file: the schedule must cover the run (HDETTrainer and hdet-train refuse "
                                             "it)",
                                             "  hdet.axes.eps: the optimizer SGD has no eps in its parameter groups, so "
                                             "there is nothing to spread; use Adam/AdamW, or drop the axis"], str(e.value)
