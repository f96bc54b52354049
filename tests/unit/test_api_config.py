"""``hdet_scale.prepare`` on the torch engines (ddp, fsdp2, fairscale) checks the DeepSpeed
keys and values as the deepspeed engine, ``hdet-train`` and ``hdet-dryrun`` do, before
``torch.distributed`` is touched (unchecked, a negative ``gradient_clipping`` would run
unclipped, an ``"hdet_config"`` block would be ignored without a word, a text LR, a one-number
``betas`` or ``"bf16": true`` would raise a TypeError / IndexError / AttributeError after the
process group had started, and ``prepare(model, None)`` a TypeError).

Each case is refused with an HDETConfigError naming the key, in this process, with no
process group: the refusal comes before any collective by construction.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hdet_scale
from hdet_scale.errors import HDETConfigError

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "hdet": {"replicas": 1, "axes": {"lr": {"spread_ratio": 0}}, "auto": {"enabled": False},
                 "schedule": {"name": "constant", "total_steps": 10}}}
CASES = [
    ({"gradient_clipping": -1}, "gradient_clipping: must be a number >= 0 (0: off), got -1"),
    ({"gradient_clipping": None}, "gradient_clipping: must be a number >= 0 (0: off), got None"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "optimizer.params.lr: must be a finite number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "0.001"}}}, "optimizer.params.lr: must be a finite number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9]}}}, "optimizer.params.betas: must be two"),
    ({"bf16": True}, 'bf16: must be a JSON object, e.g. {"enabled": true}; got true'),
    ({"hdet_config": {}}, "hdet_config: not a key of DeepSpeed or hdet_scale; did you mean 'hdet'?"),
]


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "fairscale"])
@pytest.mark.parametrize("extra,line", CASES, ids=[str(i) for i in range(len(CASES))])
def test_prepare_on_a_torch_engine_refuses_what_the_others_refuse(backend, extra, line):
    assert not torch.distributed.is_initialized()
    with pytest.raises(HDETConfigError) as e:
        hdet_scale.prepare(torch.nn.Linear(2, 2), {**copy.deepcopy(BASE), **extra}, backend=backend)
    assert line in str(e.value), str(e.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("config,line", [
    (None, "config: expected a DeepSpeed JSON path or a dict with its \"hdet\" block, got NoneType None"),
    ([1, 2], "got list [1, 2]"),
])
def test_prepare_names_a_config_that_is_neither_a_path_nor_a_dict(config, line):
    with pytest.raises(HDETConfigError, match=line.replace("[", r"\[").replace("]", r"\]")):
        hdet_scale.prepare(torch.nn.Linear(2, 2), config, backend="ddp")


def test_a_file_that_is_not_a_json_object_is_named(tmp_path):
    # JSON's own names for what the file holds, not Python's ("NoneType")
    for text, line in (("[1, 2]", "must hold a JSON object ({\"hdet\": {...}, ...}), got a JSON array"),
                       ("null", "got a JSON null"), ('"x"', "got a JSON string"), ("{nope", "is not valid JSON")):
        path = tmp_path / "ds.json"
        path.write_text(text)
        with pytest.raises(HDETConfigError) as e:
            hdet_scale.prepare(torch.nn.Linear(2, 2), str(path), backend="ddp")
        assert "ds.json" in str(e.value) and line in str(e.value), str(e.value)


def test_deepspeed_initialize_without_an_optimizer_is_refused_before_any_collective():
    """A DeepSpeed config with no "optimizer" block (Megatron-DeepSpeed's style) and no
    optimizer= is refused before the process group: DeepSpeed would build no optimizer and
    call no lr_scheduler factory, a ``KeyError: 's'`` in every rank."""
    pytest.importorskip("deepspeed")
    import torch

    from hdet_scale.backends.deepspeed import initialize

    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "hdet": {"replicas": 1, "schedule": {"total_steps": 10}}}
    with pytest.raises(HDETConfigError, match=r"^optimizer: HDET sets the optimizer's LR per replica, and this "
                                              r"DeepSpeed config has no 'optimizer' block and no optimizer= was given"):
        initialize(torch.nn.Linear(2, 2), ds)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "fairscale"])
def test_a_deepspeed_config_without_an_hdet_block_is_named_as_such(backend):
    """``prepare`` with a DeepSpeed-style config that has no ``"hdet"`` block says in
    one line that the block is missing, rather than reading the whole config as the
    block ("hdet.train_micro_batch_size_per_gpu: unknown key", "hdet.optimizer: unknown
    key"); the bare block itself is still taken by the backends' resolve_config."""
    from hdet_scale.backends.common import resolve_config

    ds = {k: v for k, v in copy.deepcopy(BASE).items() if k != "hdet"}
    with pytest.raises(HDETConfigError) as e:
        hdet_scale.prepare(torch.nn.Linear(2, 2), ds, backend=backend)
    assert str(e.value).startswith("hdet config: a DeepSpeed-style config (keys optimizer, "
                                   "train_micro_batch_size_per_gpu) without an \"hdet\" block"), str(e.value)
    assert "unknown key" not in str(e.value)
    assert resolve_config(BASE["hdet"], world=1).replicas == 1  # the block alone
    assert not torch.distributed.is_initialized()


def test_an_optimizer_instance_instead_of_a_function_is_named():
    """``prepare(..., optimizer=torch.optim.AdamW(...))`` is refused with a line saying that
    the argument takes a function ``params -> optimizer`` (the engine builds it over the
    parameters it wraps), not "TypeError: 'AdamW' object is not callable" from inside
    prepare."""
    model = torch.nn.Linear(2, 2)
    for bad in (torch.optim.AdamW(model.parameters()), "AdamW"):
        with pytest.raises(HDETConfigError, match=r"^optimizer: expected a function params -> torch.optim.Optimizer"):
            hdet_scale.prepare(model, copy.deepcopy(BASE), backend="ddp", optimizer=bad)
    assert not torch.distributed.is_initialized()


def test_an_optimizer_function_beside_the_configs_block_is_refused():
    """``optimizer=`` beside the config's ``optimizer`` block (another type, LR and
    betas) would replace the block without a word: refused as Accelerate refuses the
    pair, on every engine, before torch.distributed starts."""
    model = torch.nn.Linear(2, 2)
    for backend in ("deepspeed", "fsdp2", "ddp", "fairscale"):
        with pytest.raises(HDETConfigError, match=r"^optimizer: the config's \"optimizer\" block \(AdamW\) and "
                                                  r"optimizer= both give the optimizer"):
            hdet_scale.prepare(model, copy.deepcopy(BASE), backend=backend,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert not torch.distributed.is_initialized()


def test_an_optimizer_zero_calls_untested_is_named_before_deepspeed_starts():
    """``prepare(backend="deepspeed", optimizer=SGD...)`` under ZeRO is an HDETConfigError
    naming ``zero_allow_untested_optimizer``, before torch.distributed starts, not
    DeepSpeed's AssertionError ("untested ZeRO Optimizer") inside ``deepspeed.initialize``
    on every rank; with that key the check lets it through to DeepSpeed."""
    from hdet_scale.ds_values import check_client_optimizer

    cfg = {k: v for k, v in copy.deepcopy(BASE).items() if k != "optimizer"}
    cfg["zero_optimization"] = {"stage": 3}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(HDETConfigError, match=r"^optimizer: SGD is not among the optimizers DeepSpeed's ZeRO lists "
                                              r"as tested .*\"zero_allow_untested_optimizer\": true"):
        hdet_scale.prepare(model, copy.deepcopy(cfg), backend="deepspeed",
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert not torch.distributed.is_initialized()
    sgd, adamw = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())
    check_client_optimizer({**cfg, "zero_allow_untested_optimizer": True}, sgd)
    check_client_optimizer(cfg, adamw)
    check_client_optimizer({**cfg, "zero_optimization": {"stage": 0}}, sgd)  # no ZeRO: DeepSpeed does not ask
    # no block and no optimizer= on a torch engine: named as such, not "optimizer.type: ... got None"
    for backend in ("ddp", "fsdp2", "fairscale"):
        with pytest.raises(HDETConfigError, match=r"^optimizer: HDET sets the optimizer's LR per replica, and this "
                                                  r"DeepSpeed config has no 'optimizer' block and no optimizer= "):
            hdet_scale.prepare(model, copy.deepcopy(cfg), backend=backend)
    assert not torch.distributed.is_initialized()


ZERO_INIT_THEN_PREPARE = """
import sys, torch, hdet_scale
from hdet_scale.errors import HDETConfigError
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "hdet": {"replicas": 1, "axes": {"lr": {"spread_ratio": 0}}, "auto": {"enabled": False},
                "schedule": {"name": "constant", "total_steps": 10}}}
topo = hdet_scale.build_topology(cfg)
with hdet_scale.zero_init(topo, cfg):
    model = torch.nn.Linear(8, 1)
for backend in ("ddp", "fsdp2"):
    try:
        hdet_scale.prepare(model, cfg, backend=backend, topology=topo)
        print("ACCEPTED", backend)
    except HDETConfigError as e:
        print("REFUSED", e)
"""


def test_a_model_built_under_zero_init_is_refused_by_the_torch_engines(tmp_path):
    """prepare(backend="ddp" / "fsdp2") refuses a model whose parameters DeepSpeed
    partitioned (zero_init): its first forward would fail inside DeepSpeed ("mat2 must
    be a matrix, got 1-D tensor") on every rank. A real zero_init on a one-rank gloo
    world, in a child process (it starts torch.distributed)."""
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ZERO_INIT_THEN_PREPARE], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ACCEPTED", "REFUSED"))]
    assert proc.returncode == 0 and lines == [
        "REFUSED model: its parameters are partitioned by DeepSpeed (built under hdet_scale.zero_init), which only "
        "backend='deepspeed' takes; for backend='ddp' build it normally",
        "REFUSED model: its parameters are partitioned by DeepSpeed (built under hdet_scale.zero_init), which only "
        "backend='deepspeed' takes; for backend='fsdp2' build it normally, or sharded under torch.device('meta') "
        "with shard_modules= and init_weights="], (proc.stdout, proc.stderr[-3000:])


def test_step_and_backward_out_of_order_are_refused():
    """step() twice per micro-batch (library, ddp and deepspeed, 2 ranks) would make every
    other update one without a gradient, recording a loss of 0 as auto-LR's fitness; step()
    every other micro-batch with gradient_accumulation_steps=2 would run half the optimizer
    steps on twice the mean gradient. Both silently, so both are refused. The Ensemble's
    counting here on a real model (a micro-batch that is not a step's last needs no
    scheduler); the right order is held to the engines by tests/distributed/test_api.py."""
    from hdet_scale.api import Ensemble

    model = torch.nn.Linear(2, 1)
    ens = Ensemble("ddp", model, None, None, grad_accum=2, clip=0.0)
    with pytest.raises(HDETConfigError, match=r"Ensemble.step: no backward since the last step\(\)"):
        ens.step()
    ens.backward(model(torch.ones(1, 2)).sum())
    assert ens.step() is False  # the first of two micro-batches
    ens.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(HDETConfigError, match=r"Ensemble.backward: called again before step\(\).*= 2"):
        ens.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None and torch.equal(model.weight.grad, torch.ones(1, 2))  # 2 x 1/2: no third


def test_a_float_loss_is_named_and_counts_no_backward():
    """``ens.backward(loss.item())`` names the fix (a TypeError, not AttributeError
    "'float' object has no attribute 'backward'"), and the micro-batch is not counted (the
    tensor's backward right after is accepted and yields the same gradient)."""
    from hdet_scale.api import Ensemble

    model = torch.nn.Linear(2, 1)
    ens = Ensemble("ddp", model, None, None, grad_accum=2, clip=0.0)
    with pytest.raises(TypeError, match=r"Ensemble.backward: loss must be .* got float .*not loss.item\(\)"):
        ens.backward(model(torch.ones(1, 2)).sum().item())
    ens.backward(model(torch.ones(1, 2)).sum())
    assert torch.equal(model.weight.grad, torch.full((1, 2), 0.5))  # 1/2 of one micro-batch's gradient


def test_a_checkpoint_in_the_middle_of_an_optimizer_step_is_refused(tmp_path):
    """save_checkpoint after the first of two micro-batches is refused before anything
    is written (every rank counts the same micro-batches): the checkpoint would lack the
    pending gradient, and the resumed run would drop it, silently."""
    from hdet_scale.api import Ensemble
    from hdet_scale.errors import HDETStateError

    model = torch.nn.Linear(2, 1)
    ens = Ensemble("ddp", model, None, None, grad_accum=2, clip=0.0)
    ens.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(HDETStateError, match=r"called after 1 of the 2 micro-batches of optimizer step 1 .*"
                                             r"save when ens.step\(\) returned True"):
        ens.save_checkpoint(str(tmp_path / "ckpt"))
    assert ens.step() is False
    with pytest.raises(HDETStateError, match=r"called after 1 of the 2 micro-batches"):
        ens.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    # a load with a micro-batch pending would carry its gradient into the loaded state's
    # next step
    with pytest.raises(HDETStateError, match=r"Ensemble.load_checkpoint: called after 1 of the 2 micro-batches.*"
                                             r"would be added to the loaded state's next step"):
        ens.load_checkpoint(str(tmp_path / "ckpt"))


def test_a_step_past_total_steps_is_refused_before_the_optimizer_moves_a_weight():
    """The step past ``schedule.total_steps`` (ddp, 2 ranks) is refused before the
    optimizer steps, so the weights are never one step past the state the scheduler
    describes. With a real HDETScheduler at its last step and a real optimizer: the
    weights are unchanged."""
    from hdet_scale.api import Ensemble
    from hdet_scale.config import HDETConfig
    from hdet_scale.ensemble import HDETScheduler

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = HDETConfig.from_dict({"replicas": 2, "schedule": {"total_steps": 10}, "auto": {"enabled": False}})
    sched = HDETScheduler(cfg, {0: [{"lr": 0.1, "params": []}]})
    sched.step_count = 10  # the state after the last step of the run (as loaded from a checkpoint)
    ens = Ensemble("ddp", model, opt, sched, grad_accum=1, clip=0.0)
    before = model.weight.detach().clone()
    ens.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(ValueError, match=r"Tried to step 11 times\. The specified number of total steps is 10 "
                                         r"\(hdet.schedule.total_steps"):
        ens.step()
    assert torch.equal(model.weight, before) and sched.step_count == 10


def test_a_world_of_one_names_the_launcher():
    """``python train.py`` (one process) is told more than that 2 replicas do not divide a
    world of 1: the message names torchrun and the deepspeed launcher. Other worlds keep
    the plain message."""
    from hdet_scale.topology import Layout

    with pytest.raises(HDETConfigError, match=r"world of 1 ranks; allowed values for this world: \[1\] \(a world of "
                                              r"1: a script started with plain `python` instead of `torchrun"):
        Layout(1, 2)
    with pytest.raises(HDETConfigError) as e:
        Layout(4, 3)
    assert "plain `python`" not in str(e.value)


MISUSED_ENSEMBLE = """
import sys, torch, hdet_scale
from hdet_scale.errors import HDETConfigError, HDETStateError
cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "hdet": {"replicas": 1, "axes": {"lr": {"spread_ratio": 0}}, "auto": {"enabled": False},
                "schedule": {"name": "constant", "total_steps": 10}}}
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
ens = hdet_scale.prepare(model, cfg, backend="ddp")
try:
    hdet_scale.prepare(model, cfg, backend="ddp")
    print("ACCEPTED second prepare")
except HDETConfigError as e:
    print("REFUSED", e)
x = torch.ones(2, 4)
for micro in range(4):
    ens.backward(ens.model(x).pow(2).mean())
    if ens.step():
        try:
            ens.scheduler.step(0.5)  # as the plain-scheduler loop would
            print("ACCEPTED extra scheduler.step")
        except HDETConfigError as e:
            print("REFUSED", e)
print("STEPS", ens.scheduler.step_count)
for tag in ("../escape", "a/b", " x", "", "latest", "hdet_layout.json"):
    try:
        ens.save_checkpoint(sys.argv[1], tag=tag)
        print("ACCEPTED tag", repr(tag))
    except HDETStateError as e:
        print("REFUSED", str(e).split(":")[0])
"""


def test_a_misused_ensemble_is_refused(tmp_path):
    """A misused Ensemble (library, 2 ranks) is refused, each way that would otherwise go
    without a word: a second prepare of one model (its parameters wrapped in a second engine
    and scheduler); a loop that also calls ens.scheduler.step(loss) after ens.step() (the
    schedule would move twice per optimizer step, 4 after 2); a tag with '/' or '..' (every
    replica into one folder); a tag named as the folders' own files (``latest``). A real DDP
    Ensemble on a one-rank gloo world, in a child process: each is refused, and the schedule
    counts the 2 optimizer steps of 4 micro-batches."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MISUSED_ENSEMBLE, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ACCEPTED", "REFUSED", "STEPS"))]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0].startswith("REFUSED model: already prepared by hdet_scale.prepare (backend='ddp')"), lines
    assert lines[1] == lines[2] and lines[1].startswith(
        "REFUSED HDETScheduler.step: the Ensemble of hdet_scale.prepare (ens.step()) steps this scheduler itself"), lines
    assert lines[3] == "STEPS 2", lines
    assert lines[4:] == ["REFUSED checkpoint tag '../escape'", "REFUSED checkpoint tag 'a/b'",
                         "REFUSED checkpoint tag ' x'", "REFUSED checkpoint tag ''",
                         # DeepSpeed's link in each replica folder, the index
                         "REFUSED checkpoint tag 'latest'", "REFUSED checkpoint tag 'hdet_layout.json'"], lines
    assert not (tmp_path / "escape").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kwarg", ["lr_scheduler", "mpu", "mesh_param", "config_params"])
def test_a_deepspeed_keyword_hdet_gives_itself_is_refused_before_anything_starts(kwarg):
    """``hdet_scale.initialize(..., lr_scheduler=...)`` (or ``mpu=``) is refused with the
    block on, naming the keyword and what HDET gives there, before torch.distributed
    starts (no process group exists here), not deepspeed.initialize's raw ``TypeError: got
    multiple values for keyword argument``."""
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    from hdet_scale.backends import deepspeed as ds_backend

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "hdet": {"replicas": 1, "schedule": {"total_steps": 10}, "logging": {"wandb": {"enabled": False}}}}
    with pytest.raises(HDETConfigError, match=rf"^hdet_scale.initialize: {kwarg}= is HDET's to give DeepSpeed: "):
        ds_backend.initialize(torch.nn.Linear(4, 4), cfg, **{kwarg: object()})
    assert not dist.is_initialized()
