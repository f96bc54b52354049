"""The trainer's run config: packaged YAML defaults, a user YAML, ``key=value`` overrides.

Merged with OmegaConf against a structured schema, so an unknown or mistyped key is an
error naming it. The ``deepspeed`` section is the DeepSpeed JSON (``deepspeed_config``)
with overrides merged on top; its ``hdet`` block is validated by ``HDETConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import yaml
from importlib import resources
from typing import Any

from hdet_scale.config import WandbConfig
from hdet_scale.errors import HDETConfigError
from hdet_scale.backends import BACKENDS
from hdet_scale.train.model import ModelConfig



@dataclass
class DataConfig:
    path: str | None = None
    val_fraction: float = 0.1
    max_bytes: int = 4_000_000
    seq_len: int = 128


@dataclass
class TrainConfig:
    steps: int = 300
    eval_batches: int = 16
    probe_batches: int = 2
    checkpoint: bool = True
    checkpoint_every: int | None = 0
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False
    progress: bool = True


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    backend: str = "deepspeed"
    nproc: int = 4
    deepspeed_config: str | None = None
    deepspeed: Any = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # The hdet block's W&B settings, on by default here; group/name/dir default to run_dir.
    wandb: WandbConfig = field(default_factory=lambda: WandbConfig(enabled=True, project="hdet-scale"))


def packaged(name: str) -> str:
    return str(resources.files("hdet_scale.train") / "configs" / name)


def load_run_config(path: str | None, overrides: list[str]) -> dict:
    """Resolve the run config to a plain dict (``deepspeed`` fully merged).

    Raises:
        HDETConfigError: unknown key, wrong type, unreadable file, or invalid value.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(packaged("default.yaml")))
        if path is not None:
            cfg = OmegaConf.merge(cfg, _load_yaml(path, overrides))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise HDETConfigError(f"overrides must be key=value (e.g. train.steps=10), got {bad}")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as e:
        raise HDETConfigError(_describe(e)) from None
    run = OmegaConf.to_container(cfg, resolve=True)
    ds_path = run["deepspeed_config"] or packaged("deepspeed.json")
    ds = _load_deepspeed_json(ds_path)
    if not isinstance(run["deepspeed"] or {}, dict):
        raise HDETConfigError(f"deepspeed: must be a mapping of DeepSpeed keys (merged into {ds_path}), "
                              f"got {run['deepspeed']!r}")
    try:
        run["deepspeed"] = OmegaConf.to_container(OmegaConf.merge(ds, run["deepspeed"] or {}), resolve=True)
    except OmegaConfBaseException as e:
        raise HDETConfigError(f"deepspeed: {_describe(e)} (merging the overrides into {ds_path})") from None
    _validate(run)
    return run


def _read_text(path: str, what: str) -> str:
    """The text of ``path``; HDETConfigError naming ``what`` and the file otherwise."""
    if not os.path.exists(path):
        raise HDETConfigError(f"{what} {path!r} does not exist")
    if os.path.isdir(path):
        raise HDETConfigError(f"{what} {path!r} is a folder, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise HDETConfigError(f"{what} {path!r} is not UTF-8 text (byte {e.start}): is it the right file?") from None
    except OSError as e:
        raise HDETConfigError(f"{what} {path!r} cannot be read: {e.strerror}") from None


def _load_yaml(path: str, overrides: list[str]) -> Any:
    """The user's run config file: a YAML mapping of trainer keys."""
    from omegaconf import OmegaConf

    if not os.path.exists(path) and not path.endswith((".yaml", ".yml", ".json")):
        # "hdet-train train.steps 10": a key without "=" read as the config file's name
        hint = f" (did you mean {path}={overrides[0]}?)" if overrides and "=" not in overrides[0] else ""
        raise HDETConfigError(f"{path!r} is neither key=value nor an existing config file{hint}: hdet-train takes "
                              "an optional CONFIG.yaml first, then key=value overrides, e.g. train.steps=10")
    text = _read_text(path, "config file")
    try:
        top = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = " ".join(str(e).replace('"<unicode string>"', repr(path)).split())
        raise HDETConfigError(f"config file {path!r} is not valid YAML: {where}") from None
    if not isinstance(top, (dict, type(None))):
        kind = "list" if isinstance(top, list) else f"single value ({top!r})"
        raise HDETConfigError(f"config file {path!r} must hold a YAML mapping of trainer keys (run_dir: ..., "
                              f"train: {{steps: ...}}), got a {kind}")
    ds_keys = sorted(set(top or {}) & {"hdet", "train_micro_batch_size_per_gpu", "train_batch_size",
                                        "zero_optimization", "optimizer", "gradient_accumulation_steps"})
    if ds_keys and not set(top) & {f.name for f in dataclasses.fields(RunConfig)}:
        raise HDETConfigError(f"config file {path!r} looks like a DeepSpeed JSON (keys {', '.join(ds_keys)}): pass "
                              f"it as deepspeed_config={path}; the first argument is the trainer's YAML")
    return OmegaConf.create(text)  # OmegaConf's YAML loader: it reads 1e-3 as a float, PyYAML does not


def _load_deepspeed_json(path: str) -> dict:
    """The DeepSpeed JSON of ``deepspeed_config``: one JSON object."""
    text = _read_text(path, "deepspeed_config: file")
    if not text.strip():
        raise HDETConfigError(f"deepspeed_config: file {path!r} is empty; it must hold a DeepSpeed JSON object")
    try:
        ds = json.loads(text)
    except ValueError as e:
        raise HDETConfigError(f"deepspeed_config: file {path!r} is not valid JSON: {e}") from None
    if not isinstance(ds, dict):
        raise HDETConfigError(f"deepspeed_config: file {path!r} must hold a JSON object ({{\"hdet\": {{...}}, "
                              f"...}}), got a JSON {type(ds).__name__}")
    return ds


def _describe(e: Exception) -> str:
    """One line naming the dotted key, and for an unknown key the valid ones."""
    key = getattr(e, "full_key", None) or ""
    msg = getattr(e, "msg", None) or str(e)
    msg = msg.splitlines()[0]
    if "not in" in msg and key:
        node: Any = RunConfig
        for part in key.split(".")[:-1]:
            fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
            node = fields[part].default_factory() if part in fields and fields[part].default_factory \
                is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(node):
            valid = ", ".join(f.name for f in dataclasses.fields(node))
            return f"{key}: unknown key; valid keys: {valid}"
    return f"{key}: {msg}" if key else msg


def _validate(run: dict) -> None:
    errors = []
    if run["backend"] not in BACKENDS:
        errors.append(f"backend: must be one of {', '.join(BACKENDS)}, got {run['backend']!r}")
    if run["nproc"] < 1:
        errors.append(f"nproc: must be >= 1, got {run['nproc']}")
    t, d = run["train"], run["data"]
    if t["steps"] < 1:
        errors.append(f"train.steps: must be >= 1 (optimizer steps), got {t['steps']}")
    if t["eval_batches"] < 1:
        errors.append(f"train.eval_batches: must be >= 1, got {t['eval_batches']}")
    if t["checkpoint_every"] is not None and t["checkpoint_every"] < 0:
        errors.append(f"train.checkpoint_every: must be an integer >= 0 (optimizer steps; 0 or null: off), "
                      f"got {t['checkpoint_every']}")
    if t["keep_checkpoints"] < 1:
        errors.append(f"train.keep_checkpoints: must be >= 1 (the newest checkpoints kept), got {t['keep_checkpoints']}")
    if t["probe_batches"] < 1:
        errors.append(f"train.probe_batches: must be >= 1 (micro-batches per shard rank), got {t['probe_batches']}")
    if run["wandb"]["mode"] not in (None, "online", "offline", "disabled"):
        errors.append(f"wandb.mode: must be null, 'online', 'offline' or 'disabled', got {run['wandb']['mode']!r}")
    if d["seq_len"] < 1 or d["seq_len"] > run["model"]["max_seq_len"]:
        errors.append(f"data.seq_len: must be in [1, model.max_seq_len={run['model']['max_seq_len']}], "
                      f"got {d['seq_len']}")
    if errors:
        raise HDETConfigError("invalid run config:\n  " + "\n  ".join(errors))
    ModelConfig(**run["model"]).validate()
    _check_deepspeed_values(run["deepspeed"])
    hdet = run["deepspeed"].setdefault("hdet", {})
    sched = hdet.setdefault("schedule", {})
    if sched.get("total_steps") is None:
        sched["total_steps"] = t["steps"]
    elif sched["total_steps"] < t["steps"]:
        raise HDETConfigError(f"deepspeed.hdet.schedule.total_steps: {sched['total_steps']} is shorter than "
                              f"train.steps={t['steps']}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_deepspeed_values(ds: dict) -> None:
    """The ``deepspeed`` section's values that every backend reads, checked before any rank
    starts (DeepSpeed itself would fail inside every rank, with a traceback, or train on a
    negative, NaN or boolean LR without a word). Raises HDETConfigError naming each key."""
    errors = []
    if "hdet" in ds and not isinstance(ds["hdet"], dict):
        errors.append(f"deepspeed.hdet: expected an object (the HDET block), got {ds['hdet']!r}")
    opt = ds.get("optimizer", {})
    if not isinstance(opt, dict):
        errors.append(f"deepspeed.optimizer: expected an object with 'type' and 'params', got {opt!r}")
        opt = {}
    params = opt.get("params", {})
    if params is not None and not isinstance(params, dict):
        errors.append(f"deepspeed.optimizer.params: expected an object (e.g. {{lr: 3e-4}}), got {params!r}")
        params = {}
    params = params or {}
    if "lr" in params and not (_number(params["lr"]) and params["lr"] > 0):
        errors.append(f"deepspeed.optimizer.params.lr: must be a finite number > 0 (the peak LR), got {params['lr']!r}")
    betas = params.get("betas")
    if betas is not None and not (isinstance(betas, (list, tuple)) and len(betas) == 2
                                  and all(_number(b) and 0 <= b < 1 for b in betas)):
        errors.append(f"deepspeed.optimizer.params.betas: must be two numbers in [0, 1), got {betas!r}")
    for key in ("eps", "weight_decay"):
        if key in params and not (_number(params[key]) and params[key] >= 0):
            errors.append(f"deepspeed.optimizer.params.{key}: must be a finite number >= 0, got {params[key]!r}")
    clip = ds.get("gradient_clipping", 1.0)
    if not (_number(clip) and clip >= 0):
        errors.append(f"deepspeed.gradient_clipping: must be a number >= 0 (0: off), got {clip!r}")
    if errors:
        raise HDETConfigError("invalid run config:\n  " + "\n  ".join(errors))
