"""The trainer's run config: packaged YAML defaults, a user YAML, ``key=value`` overrides.

Merged with OmegaConf against a structured schema, so an unknown or mistyped key is an
error naming it; each override is parsed alone (a bad value, a key given twice, a section
given as a value: the message names the override) and interpolations are resolved here. The ``deepspeed`` section is the DeepSpeed JSON (``deepspeed_config``)
with overrides merged on top; its ``hdet`` block is validated by ``HDETConfig``, its
values by :func:`hdet_scale.ds_values.check_deepspeed_values`. The hdet block's
``logging.wandb.*`` keys are the defaults of the trainer's ``wandb.*`` (``_hdet_logging``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

import yaml
from importlib import resources
from typing import Any

from hdet_scale.config import BLOCK_EXAMPLE, WandbConfig
from hdet_scale.config_checks import MAX_STEPS, seed_ok
from hdet_scale.ds_values import check_deepspeed_values
from hdet_scale.train.config_merge import container_clash as _container_clash
from hdet_scale.train.config_merge import empty_over_full as _empty_over_full
from hdet_scale.train.config_merge import null_over_file_hint
from hdet_scale.train.config_merge import refuse_empty_over_full as _refuse_empty_over_full
from hdet_scale.train.optimizer_switch import drop_foreign_params, drop_foreign_schedule
from hdet_scale.errors import HDETConfigError
from hdet_scale.safe_parse import yaml_load
from hdet_scale.backends import BACKENDS
from hdet_scale.train.config_errors import describe
from hdet_scale.train.config_overrides import parse_overrides
from hdet_scale.train.model_config import ModelConfig
from hdet_scale.train.config_files import load_deepspeed_json, read_text, repeated_key, yaml11_scalar



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
    plots: bool = True


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


# The sections of the run config that hold keys of their own, with an example key for messages.
_SECTIONS = {"model": ("hidden_size", 256), "data": ("path", "/my/corpus"), "train": ("steps", 100),
             "wandb": ("enabled", False), "deepspeed": ("train_micro_batch_size_per_gpu", 4)}


def _leaf_keys(node: Any = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the run config's schema (``deepspeed.*`` not included)."""
    out = []
    for f in dataclasses.fields(node):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            out += _leaf_keys(type(sub), f"{prefix}{f.name}.")
        elif f.name != "deepspeed":
            out.append(f"{prefix}{f.name}")
    return out


def option_message(arg: str, value: str | None = None) -> str:
    """What to write for a command-line option (``--steps``, ``--steps=10``), which
    hdet-train does not take: the ``key=value`` override of that name (not "did you
    mean --steps=10?", which would be refused in turn)."""
    name, _, given = arg.lstrip("-").partition("=")
    value = given or value or "..."
    name = name.replace("-", "_")
    matches = [k for k in _leaf_keys() if k == name or k.endswith("." + name)]
    hint = (f"; did you mean {matches[0]}={value}?" if len(matches) == 1 else
            f"; did you mean one of {', '.join(f'{k}={value}' for k in matches)}?" if matches else "")
    return (f"{arg!r}: hdet-train takes no --options but an optional CONFIG.yaml, then key=value overrides "
            f"(e.g. train.steps=10){hint}")


def packaged(name: str) -> str:
    return str(resources.files("hdet_scale.train") / "configs" / name)


def load_run_config(path: str | None, overrides: list[str]) -> dict:
    """Resolve the run config to a plain dict (``deepspeed`` fully merged).

    Raises:
        HDETConfigError: unknown key, wrong type, unreadable file, or invalid value; a
            YAML or DeepSpeed JSON nested too deeply or a YAML anchor used inside its own
            value (``safe_parse``).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    second = next((o for o in overrides if "=" not in o and o.endswith((".yaml", ".yml"))), None)
    if path is not None and second is not None:  # not "a config file goes first" (it is)
        raise HDETConfigError(f"two config files, {path!r} and {second!r}: hdet-train reads one (hdet-train "
                              "CONFIG.yaml key=value ...); merge them, or give the second's settings as key=value")
    explicit_wandb: set = set()  # the wandb.* keys the user sets (they win over the hdet block's)
    cfg, merging = None, None  # merging: which input a value error came from
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(packaged("default.yaml")))
        if path is not None:
            user, sections = _load_yaml(path, overrides)
            check_sections(sections, f"config file {path!r}: ", yaml_form=True)
            _check_bools(sections, f"config file {path!r}: ")
            explicit_wandb |= set(sections.get("wandb") or {})
            merging = "file"
            cfg = OmegaConf.merge(cfg, user)
        merging = "overrides"
        dotlist, sections = parse_overrides(overrides)
        _check_bools(sections, "")
        explicit_wandb |= set(sections.get("wandb") or {})
        cfg = OmegaConf.merge(cfg, dotlist)
        # Interpolations (${...}) are resolved here, once: a bad one is a config error
        # naming its key, not a traceback wherever the value is first read.
        run = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise HDETConfigError(describe(e, cfg, overrides, path, merging)) from None
    # "~" as a shell expands it, as for data.path (else run_dir: ~/x in a YAML writes
    # into ./~/x, and the plots line names the home folder)
    for section, key in ((run, "run_dir"), (run, "deepspeed_config"), (run["wandb"], "dir")):
        if isinstance(section.get(key), str):
            section[key] = os.path.expanduser(section[key])
    ds_path = run["deepspeed_config"] or packaged("deepspeed.json")
    ds = load_deepspeed_json(ds_path)
    if not isinstance(run["deepspeed"] or {}, dict):
        raise HDETConfigError(f"deepspeed: must be a mapping of DeepSpeed keys (merged into {ds_path}), "
                              f"got {run['deepspeed']!r}")
    clash = _container_clash(ds, run["deepspeed"] or {}, "deepspeed")
    if clash:  # OmegaConf raises a bare TypeError ("Cannot merge incompatible container types")
        raise HDETConfigError(f"{clash} (merging the overrides into {ds_path})")
    _refuse_empty_over_full(overrides, ds, ds_path)
    given = run["deepspeed"] or {}
    empty = next(filter(None, (_empty_over_full(v, ds.get(k), f"deepspeed.{k}") for k, v in given.items())), None)
    if empty:  # the same {} from the run YAML (otherwise silent there)
        raise HDETConfigError(f"{empty[0]}: {{}} in the run config merges into {ds_path}, so it changes nothing "
                              f"there (it keeps {', '.join(map(str, empty[1]))}); set the keys inside it instead, or "
                              "give your own deepspeed_config file")
    try:
        run["deepspeed"] = OmegaConf.to_container(OmegaConf.merge(ds, given), resolve=True)
    except OmegaConfBaseException as e:
        raise HDETConfigError(f"deepspeed: {describe(e)} (merging the overrides into {ds_path})") from None
    # optimizer.type=SGD over the file's AdamW
    drop_foreign_params(ds, given, run["deepspeed"], torch_engine=run.get("backend") != "deepspeed")
    drop_foreign_schedule(ds, given, run["deepspeed"])  # schedule.name=constant over the file's onecycle
    try:
        _validate(run)
    except HDETConfigError as e:
        hint = null_over_file_hint(overrides, ds, ds_path, str(e))
        if hint is None:
            raise
        raise HDETConfigError(f"{e}\n  {hint}") from None
    from_block = _hdet_logging(run, explicit_wandb)
    unused = sorted((explicit_wandb | from_block) - {"enabled"})
    if not run["wandb"]["enabled"] and unused and os.environ.get("RANK", "0") == "0":
        # wandb.project=myproj with wandb.enabled=false would run without a word
        # (on stderr once, as _hdet_logging's warning: the launcher, or rank 0 under torchrun);
        # the same for these keys from the hdet block's logging.wandb
        keys = ", ".join(f"{'wandb' if k in explicit_wandb else 'deepspeed.hdet.logging.wandb'}.{k}="
                         f"{run['wandb'][k]!r}" for k in unused)
        print(f"hdet-train: note: {keys} {'is' if len(unused) == 1 else 'are'} not used: wandb.enabled=false starts no "
              "W&B run (metrics go to run_dir/metrics.jsonl); set wandb.enabled=true to log to W&B",
              file=sys.stderr, flush=True)
    explicit_wandb |= from_block
    _wandb_environment(run["wandb"], explicit_wandb)
    return run


#: W&B's own environment variables for the keys the packaged default.yaml fills in.
_WANDB_ENV = {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "group": "WANDB_RUN_GROUP", "name": "WANDB_NAME"}


def _wandb_environment(wandb: dict, explicit: set) -> None:
    """A ``WANDB_PROJECT`` (``WANDB_ENTITY``, ``WANDB_RUN_GROUP``, ``WANDB_NAME``) in the
    environment sets that ``wandb.*`` key unless the run config or the hdet block sets it
    (``explicit``), as the Hugging Face Trainer and ``wandb.init`` itself read them, so
    that the packaged ``project: hdet-scale`` does not win without a word."""
    for key, var in _WANDB_ENV.items():
        if key not in explicit and os.environ.get(var):
            wandb[key] = os.environ[var]


def _check_bools(top: dict, where: str) -> None:
    """The trainer's true/false keys take a boolean: OmegaConf would read ``2`` as true
    (``train.overwrite=2`` would replace a run) and ``0`` as false, where the
    hdet block refuses both (``expected bool``)."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
                if f.default_factory is not dataclasses.MISSING and f.name != "deepspeed"}
    for name, factory in sections.items():
        given = top.get(name)
        if not isinstance(given, dict) or not dataclasses.is_dataclass(schema := factory()):
            continue
        for f in dataclasses.fields(schema):
            if f.type in (bool, "bool") and f.name in given and not isinstance(given[f.name], bool) \
                    and not (isinstance(given[f.name], str) and given[f.name].startswith("${")):
                raise HDETConfigError(f"{where}{name}.{f.name}: must be true or false, got {given[f.name]!r}")


def _check_yaml_keys(tree: Any, where: str, key: str = "") -> None:
    """Keys of the run YAML that cannot name a setting: one that is not a string
    (``1: 2``, ``null: 3``: OmegaConf's "Incompatible key type" names no file), and a
    dotted key (``train.steps: 5``: YAML does not nest it, and "unknown key" does not
    say so)."""
    if not isinstance(tree, dict):
        return
    for k, v in tree.items():
        if not isinstance(k, str):
            raise HDETConfigError(f"{where}the key {k!r} ({'null' if k is None else type(k).__name__}) "
                                  f"{'in ' + key + ' ' if key else ''}is not a name: keys are names, e.g. steps")
        if "." in k:
            head, _, rest = k.partition(".")
            raise HDETConfigError(f"{where}{key + '.' if key else ''}{k}: a dotted key is not nested in YAML; write "
                                  f"{head}: {{{rest}: ...}} (or the override {key + '.' if key else ''}{k}=...)")
        _check_yaml_keys(v, where, f"{key}.{k}" if key else k)


def check_sections(top: dict, where: str, yaml_form: bool) -> None:
    """A section of keys (``train``, ``model``...) given as a single value or a list, in
    the YAML file or as an override (``train=[1,2]``, ``model=5``): one message naming it
    and the form it takes, not OmegaConf's merge error naming no key."""
    for name, (key, value) in _SECTIONS.items():
        if name in top and not isinstance(top[name], dict):
            form = (f"{name}: {{{key}: {json.dumps(value)}}}" if yaml_form else
                    f"{name}.{key}={json.dumps(value).strip(chr(34))}")
            raise HDETConfigError(f"{where}{name}: must be a mapping of {name}.* keys, e.g. {form}; "
                                  f"got {json.dumps(top[name], default=str)}")


def _hdet_logging(run: dict, explicit: set) -> set:
    """Honour ``deepspeed.hdet.logging`` (what a DeepSpeed JSON written for the library
    carries) where the trainer has the same setting. ``wandb.*``: the same keys as the
    trainer's ``wandb.*`` (``WandbConfig``); each one the hdet block sets is used unless
    the run config sets it too (``explicit``: its YAML or an override). ``every`` is the
    scheduler's own setting and applies as it is. ``jsonl`` has no trainer counterpart:
    the trainer always writes ``run_dir/metrics.jsonl`` (resume and overwrite read it),
    so it is a warning on stderr, once (the launcher; rank 0 under torchrun). Types and values of
    the block are checked by ``HDETConfig`` (``loop.validate``) before any rank starts.
    Returns the ``wandb.*`` keys the block sets."""
    block = (run["deepspeed"].get("hdet") or {}).get("logging")
    if not isinstance(block, dict):
        return set()  # absent, or not an object: HDETConfig names it
    wandb = block.get("wandb")
    given = set()
    if isinstance(wandb, dict):
        fields = {f.name for f in dataclasses.fields(WandbConfig)}
        given = {k for k in wandb if k in fields}
        run["wandb"].update({k: v for k, v in wandb.items() if k in given and k not in explicit})
    if block.get("jsonl") is not None and os.environ.get("RANK", "0") == "0":
        # On stderr like the trainer's other warnings (cli.py), not a Python warning
        # with its file and line.
        print(f"hdet-train: warning: deepspeed.hdet.logging.jsonl={block['jsonl']!r} is not used by hdet-train: "
              f"it writes its metrics to run_dir/metrics.jsonl ({os.path.join(run['run_dir'], 'metrics.jsonl')}); "
              "choose the folder with run_dir=...", file=sys.stderr, flush=True)
    return given


def _load_yaml(path: str, overrides: list[str]) -> tuple[Any, dict]:
    """The user's run config file, a YAML mapping of trainer keys: ``(OmegaConf node,
    the same as a plain dict)``."""
    from omegaconf import OmegaConf

    if not os.path.exists(path) and not path.endswith((".yaml", ".yml", ".json")):
        # "hdet-train train.steps 10": a key without "=" read as the config file's name
        value = overrides[0] if overrides and "=" not in overrides[0] else None
        if path.startswith("-"):  # "--steps 10": an option, which hdet-train does not take
            raise HDETConfigError(option_message(path, value))
        hint = f" (did you mean {path}={value}?)" if value is not None else ""
        raise HDETConfigError(f"{path!r} is neither key=value nor an existing config file{hint}: hdet-train takes "
                              "an optional CONFIG.yaml first, then key=value overrides, e.g. train.steps=10")
    text = read_text(path, "config file")
    try:
        top = yaml_load(text)
    except yaml.YAMLError as e:
        where = " ".join(str(e).replace('"<unicode string>"', repr(path)).split())
        raise HDETConfigError(f"config file {path!r} is not valid YAML: {where}") from None
    except ValueError as e:  # a recursive alias would spin for ever, deep nesting end in a traceback
        raise HDETConfigError(f"config file {path!r} {e}") from None
    # From here the text composes to a tree (safe_parse): the node walks below and
    # OmegaConf's own read of it end.
    ambiguous = yaml11_scalar(text)
    if ambiguous is not None:
        key, line, value, what = ambiguous
        raise HDETConfigError(f"config file {path!r} line {line}: {key}: {value} is {what}; write "
                              + ("true or false, or quote a string" if "boolean" in what else "the number without "
                                 "the leading 0"))
    twice = repeated_key(text)
    if twice is not None:
        key, first, again = twice
        raise HDETConfigError(f"config file {path!r} sets {key} twice (lines {first} and {again}): keep one "
                              "(YAML does not say which would win)")
    if not isinstance(top, (dict, type(None))):
        kind = "list" if isinstance(top, list) else f"single value ({top!r})"
        raise HDETConfigError(f"config file {path!r} must hold a YAML mapping of trainer keys (run_dir: ..., "
                              f"train: {{steps: ...}}), got a {kind}")
    ds_keys = sorted(set(top or {}) & {"hdet", "train_micro_batch_size_per_gpu", "train_batch_size",
                                        "zero_optimization", "optimizer", "gradient_accumulation_steps"})
    if ds_keys and not set(top) & {f.name for f in dataclasses.fields(RunConfig)}:
        raise HDETConfigError(f"config file {path!r} looks like a DeepSpeed JSON (keys {', '.join(ds_keys)}): pass "
                              f"it as deepspeed_config={path}; the first argument is the trainer's YAML")
    _check_yaml_keys(top or {}, f"config file {path!r}: ")  # before OmegaConf reads them
    if not top and os.environ.get("RANK", "0") == "0":
        # a file holding {} (or nothing) would start the full default job unsaid
        print(f"hdet-train: note: config file {path!r} holds no settings: every setting not given as key=value "
              "is the built-in default (docs/config.md lists them)", file=sys.stderr, flush=True)
    # OmegaConf's YAML loader: it reads 1e-3 as a float, PyYAML does not.
    return OmegaConf.create(text), top or {}


def _validate(run: dict) -> None:
    errors = []
    if run["backend"] not in BACKENDS:
        errors.append(f"backend: must be one of {', '.join(BACKENDS)}, got {run['backend']!r}")
    if run["nproc"] < 1:
        errors.append(f"nproc: must be >= 1, got {run['nproc']}")
    t, d = run["train"], run["data"]
    if t["steps"] < 1 or t["steps"] > MAX_STEPS:
        errors.append(f"train.steps: must be in [1, 2**53] (optimizer steps), got {t['steps']}")
    for key, seed in (("seed", run["seed"]), ("model.init_seed", run["model"]["init_seed"])):
        if not seed_ok(seed):
            errors.append(f"{key}: must be an integer in [-2**63, 2**64) (torch.manual_seed's range), got {seed}")
    if t["checkpoint_every"] and not t["checkpoint"]:
        # else saved at steps 2 and 4 but not at the end, beside a finished summary
        errors.append(f"train.checkpoint_every={t['checkpoint_every']} with train.checkpoint=false: the run would "
                      "save during training but not at its end; set train.checkpoint=true, or "
                      "train.checkpoint_every=0 for no checkpoint")
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
    if run["model"]["max_seq_len"] < 1:
        pass  # ModelConfig.validate names model.max_seq_len; the range [1, 0] would blame data.seq_len
    elif d["seq_len"] < 1 or d["seq_len"] > run["model"]["max_seq_len"]:
        errors.append(f"data.seq_len: must be in [1, model.max_seq_len={run['model']['max_seq_len']}], "
                      f"got {d['seq_len']}")
    if errors:
        raise HDETConfigError("invalid run config:\n  " + "\n  ".join(errors))
    ModelConfig(**run["model"]).validate()
    check_deepspeed_values(run["deepspeed"], prefix="deepspeed.", title="invalid run config")
    from hdet_scale.ds_keys import looks_like_hdet

    # "hdett" is not told to "add" the block the user believes they have; nor is it
    # when overrides make an hdet block without replicas beside it
    alike = "".join(f" ({k!r} is not read: did you mean 'hdet'?)" for k in run["deepspeed"] if looks_like_hdet(k))
    if run["deepspeed"].get("hdet", {}) == {}:  # null: refused above (an object expected)
        # a user's own DeepSpeed JSON without the block (or with "hdet": {}) would
        # train plain data parallelism (one replica) without a word
        where = run["deepspeed_config"] or "the DeepSpeed JSON"
        raise HDETConfigError(f"deepspeed.hdet: {where} has {'an empty' if 'hdet' in run['deepspeed'] else 'no'} hdet "
                              f"block{alike}, so the run would be plain data parallelism (one replica); hdet-train "
                              f"trains with HDET: add one, e.g. {BLOCK_EXAMPLE} (configs/deepspeed_cpu_2x2.json has "
                              "a whole block; docs/config.md), or give it as overrides (deepspeed.hdet.replicas=2 ...)")
    hdet = run["deepspeed"]["hdet"]
    if "replicas" not in hdet and hdet.get("enabled", True) is not False:
        # a block made of other keys alone (an override such as
        # deepspeed.hdet.sync_interval=5 onto a JSON without one) would run one replica,
        # plain data parallelism, while that JSON alone is refused above
        where = run["deepspeed_config"] or "the DeepSpeed JSON"
        raise HDETConfigError(f"deepspeed.hdet.replicas: the hdet block ({where} and the overrides) sets no replicas"
                              f"{alike}, "
                              "and the default, 1, is one model replica: no spread, converge or auto-LR acts and the "
                              "run would be plain data parallelism; set deepspeed.hdet.replicas=2 (or more, dividing "
                              "nproc) and a spread (deepspeed.hdet.axes.lr.spread_ratio=0.2), or "
                              "deepspeed.hdet.replicas=1 for a plain data-parallel baseline")
    dropout = (hdet.get("axes") or {}).get("dropout") if isinstance(hdet.get("axes"), dict) else None
    if isinstance(dropout, dict) and dropout.get("value") is None:
        dropout["value"] = run["model"]["dropout"]  # the dropout axis spreads around model.dropout
    elif isinstance(dropout, dict) and isinstance(dropout["value"], (int, float)) \
            and not isinstance(dropout["value"], bool) and dropout["value"] != run["model"]["dropout"]:
        # a value of another type ("0.1") is HDETConfig's to name, with its type;
        # the axis' value must not silently win over model.dropout (also over an
        # explicit model.dropout=0.0, which cannot be told from the default)
        raise HDETConfigError(f"deepspeed.hdet.axes.dropout.value={dropout['value']} and model.dropout="
                              f"{run['model']['dropout']}: in hdet-train the dropout axis spreads around "
                              "model.dropout; set model.dropout and leave the axis' value out")
    sched = hdet.setdefault("schedule", {})
    if not isinstance(sched, dict):
        return  # HDETConfig names it (loop.validate)
    total = sched.get("total_steps")
    if total is None or total == "auto":  # "auto": the run's length, as Accelerate fills it
        sched["total_steps"] = t["steps"]
    elif isinstance(total, int) and not isinstance(total, bool) and total < t["steps"]:
        raise HDETConfigError(f"deepspeed.hdet.schedule.total_steps: {sched['total_steps']} is shorter than "
                              f"train.steps={t['steps']}")
