"""The DeepSpeed-key checks without DeepSpeed (packaging): ``hdet_scale.ds_schema``.

- the shipped snapshot equals a fresh extraction from the installed DeepSpeed (drift after
  an upgrade fails here, naming the generator);
- the snapshot's answers equal the live parser's on typos at the top level, inside
  pydantic blocks (nested too), inside blocks DeepSpeed reads key by key, in
  ``optimizer.params``, an ``"hdett"`` block, blocks given as values, removed features and
  the repository's own configs (no false alarm);
- in a subprocess where ``import deepspeed`` fails (a meta-path blocker installed before
  hdet_scale is imported), ``check_deepspeed_keys`` gives the same errors and warnings as
  the parent process with DeepSpeed, ``hdet-dryrun --backend fsdp2`` passes a valid file,
  ``hdet-train``'s validation of a ``backend=fsdp2`` run succeeds (DeepSpeed asked for only
  where the key checks look for it), and ``backend=deepspeed`` is refused in one line
  naming the ``[deepspeed]`` extra (exit 2); with W&B not installed either (the
  ``[fsdp]`` extra alone), a run with W&B on is refused naming ``[wandb]``.

The independent source is DeepSpeed itself: its config parser, run in this process.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings

import pytest

from hdet_scale.errors import HDETConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGED = os.path.join(ROOT, "hdet_scale", "train", "configs", "deepspeed.json")


def _packaged(**changes) -> dict:
    """The trainer's DeepSpeed JSON with ``a__b=value`` set at ``a.b``."""
    with open(PACKAGED) as f:
        ds = json.load(f)
    ds["hdet"]["schedule"]["total_steps"] = 100
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = ds
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return ds


CASES = {
    "top_level_typo": _packaged(train_micro_batch_size_per_gpuu=2),
    "hdett": {**{k: v for k, v in _packaged().items() if k != "hdet"}, "hdett": _packaged()["hdet"]},
    "zero_typo": _packaged(zero_optimization__stagee=3),
    "zero_nested_typo": _packaged(zero_optimization__offload_param__devicee="cpu"),
    "bf16_typo": _packaged(bf16__enabledd=True),
    "wandb_typo": _packaged(wandb__projectt="x"),
    "optimizer_params": _packaged(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "learning_rate": 1e-3}}),
    "key_by_key_blocks": _packaged(activation_checkpointing__partition_activationss=True,
                                   checkpoint__tag_validationn="Warn", optimizer__typ="AdamW"),
    "blocks_as_values": _packaged(bf16=True, fp16=[1], activation_checkpointing=True,
                                  zero_optimization__offload_param="cpu"),
    "value_forms_deepspeed_takes": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": True, "aio": None},
    "removed_feature": _packaged(elasticity={"enabled": True}, zero_optimization__stagee=1),
    "lamb_params": {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb", "params": {"lrr": 1.0}}},
    "torch_adam_params": {"train_micro_batch_size_per_gpu": 1,
                          "optimizer": {"type": "Adam", "params": {"lr": 1.0, "torch_adam": True, "amsgradd": 1}}},
    "several_top_level": {"gradient_clippingg": 1.0, "steps_per_printt": 5, "HDET": {}},
}


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


REAL = {os.path.basename(p): _read(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.json"))}


@pytest.fixture(scope="module")
def live():
    pytest.importorskip("deepspeed")
    from hdet_scale import ds_keys, ds_schema

    return ds_keys, ds_schema


def test_snapshot_equals_a_fresh_extraction(live):
    _, ds_schema = live
    fresh = json.loads(ds_schema.dumps(ds_schema.extract()))
    shipped = ds_schema.load()
    assert fresh == shipped, (
        f"hdet_scale/ds_schema.json (deepspeed {shipped.get('deepspeed')}) differs from the installed deepspeed "
        f"{fresh['deepspeed']}: rerun `python -m hdet_scale.ds_schema --write` and commit the file")


@pytest.mark.parametrize("name", sorted(CASES) + sorted(REAL))
def test_snapshot_answers_like_the_live_parser(live, name):
    """The offline lines, in the same order, equal what DeepSpeed's parser finds; the
    optimizer's accepted arguments equal the live constructors' (``optimizer_accepts``)."""
    from hdet_scale.ds_values import optimizer_accepts

    ds_keys, ds_schema = live
    ds = CASES.get(name) or REAL[name]
    _, refused, unknown = ds_keys.find_problems(ds, prefix="deepspeed.")
    params = [u for u in unknown if u.startswith("deepspeed.optimizer.params.")]  # optimizer_accepts' lines
    assert ds_schema.offline_problems(ds, "deepspeed.") == (refused, [u for u in unknown if u not in params])
    opt = ds.get("optimizer", {})
    lname, torch_adam = str(opt.get("type", "")).lower(), bool(opt.get("params", {}).get("torch_adam"))
    if ds_schema.optimizer_key(lname, torch_adam) in ds_schema.load()["optimizers"]:
        assert ds_schema.snapshot_optimizer(lname, torch_adam) == optimizer_accepts(ds)
    if name in CASES and name != "value_forms_deepspeed_takes":
        assert refused or unknown or name == "hdett"  # each bad case is found (hdett: by the hdet check)


# Run with DeepSpeed made unimportable; reads the cases on stdin, prints the answers.
_WITHOUT_DEEPSPEED = r'''
import contextlib, importlib.abc, io, json, os, sys, traceback, warnings

ASKED = []  # (module, the hdet_scale file that asked)

class NoDeepSpeed(importlib.abc.MetaPathFinder):  # nor wandb: the [fsdp] extra alone
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("deepspeed", "wandb"):
            ours = [f.filename for f in traceback.extract_stack() if "hdet_scale" in f.filename]
            if name.startswith("deepspeed"):
                ASKED.append((name, os.path.basename(ours[-1]) if ours else "?"))
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoDeepSpeed())
try:
    import deepspeed
    sys.exit("the blocker did not block deepspeed")
except ModuleNotFoundError:
    ASKED.clear()

from hdet_scale.ds_keys import check_deepspeed_keys
from hdet_scale.errors import HDETConfigError

def answers(ds):
    out = []
    for strict in (True, False):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(["ok", check_deepspeed_keys(ds, strict=strict, prefix="deepspeed." if strict else "")])
        except HDETConfigError as e:
            out.append(["error", str(e)])
    return out

args = json.load(sys.stdin)
result = {"keys": {name: answers(ds) for name, ds in args["cases"].items()}, "asked_by_keys": sorted(set(ASKED))}
ASKED.clear()
from hdet_scale.dryrun import main as dryrun
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    result["dryrun"] = [dryrun(["--backend", "fsdp2", args["valid"], "--world-size", "4", "--total-steps", "10"]),
                        err.getvalue()]
from hdet_scale.train.config import load_run_config
from hdet_scale.train.loop import validate
run = load_run_config(None, ["backend=fsdp2", "nproc=2", "data.max_bytes=200000", "train.steps=6",
                             "deepspeed.hdet.sync_interval=3", "deepspeed.hdet.auto.enabled=false",
                             "wandb.enabled=false", "train.eval_batches=2", f"run_dir={args['run_dir']}"])
hcfg, _ = validate(run, 2, build_model=False)
result["fsdp2_validate"] = [hcfg.replicas, sorted(set(ASKED))]
from hdet_scale.train.cli import main as hdet_train
with contextlib.redirect_stderr(io.StringIO()) as err:
    result["deepspeed_backend"] = [hdet_train(["backend=deepspeed", f"run_dir={args['run_dir']}2"]), err.getvalue()]
with contextlib.redirect_stderr(io.StringIO()) as err:  # W&B on (the default), not installed
    result["no_wandb"] = [hdet_train(["backend=fsdp2", "data.max_bytes=200000", f"run_dir={args['run_dir']}3"]),
                          err.getvalue()]
print(json.dumps(result))
'''


def _answers(check, ds) -> list:
    out = []
    for strict in (True, False):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(["ok", check(ds, strict=strict, prefix="deepspeed." if strict else "")])
        except HDETConfigError as e:
            out.append(["error", str(e)])
    return out


def test_without_deepspeed_the_same_errors_and_an_fsdp2_run_validates(live, tmp_path):
    ds_keys, _ = live
    valid = _packaged(hdet__auto__warmup_steps=2, hdet__sync_interval=5, hdet__schedule__total_steps=10)
    (tmp_path / "ok.json").write_text(json.dumps(valid))
    args = {"cases": CASES, "valid": str(tmp_path / "ok.json"), "run_dir": str(tmp_path / "run")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_DEEPSPEED], input=json.dumps(args), capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, ds in CASES.items():
        assert got["keys"][name] == _answers(ds_keys.check_deepspeed_keys, ds), name
    strict_typo = got["keys"]["top_level_typo"][0]
    assert strict_typo[0] == "error" and "deepspeed.train_micro_batch_size_per_gpuu: unknown DeepSpeed key" \
        in strict_typo[1] and "did you mean 'train_micro_batch_size_per_gpu'?" in strict_typo[1]
    assert "not an argument of deepspeed.FusedAdam" in got["keys"]["optimizer_params"][0][1]
    assert "did you mean 'hdet'?" in got["keys"]["hdett"][1][1]  # refused by the library too
    # DeepSpeed was asked for only where the key checks look for it (then the snapshot is read)
    assert {who for _, who in got["asked_by_keys"]} <= {"ds_keys.py", "ds_values.py"}, got["asked_by_keys"]
    assert got["dryrun"][0] == 0, got["dryrun"][1]
    replicas, asked = got["fsdp2_validate"]
    assert replicas == 2 and {who for _, who in asked} <= {"ds_keys.py"}, asked
    code, err = got["deepspeed_backend"]
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("hdet-train: error: backend=deepspeed: DeepSpeed cannot be imported here") \
        and 'pip install "hdet-scale[deepspeed]"' in err, err
    assert got["no_wandb"] == [2, ('hdet-train: error: wandb.enabled=true, but wandb is not installed: pip install '
                                   '"hdet-scale[wandb]", or set wandb.enabled=false\n')], got["no_wandb"]


def test_the_snapshot_ships_in_the_wheel():
    """Without it an installed package would fail on its first key check."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["hdet_scale"]
    assert "ds_schema.json" in data and os.path.isfile(os.path.join(ROOT, "hdet_scale", "ds_schema.json"))
