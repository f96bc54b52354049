"""A DeepSpeed config with its ``"hdet"`` block, read and validated before anything
starts (:func:`prepare_config`: ``hdet_scale.initialize``, ``hdet-dryrun``, ``hdet-train``
and the Hugging Face integration all run it). No communication; DeepSpeed itself is
optional here (``hdet-dryrun`` runs without it)."""

from __future__ import annotations

import copy
import difflib
import os
import re
from typing import Any, Mapping

import torch

from hdet_scale.backends.common import world_size as common_world_size
from hdet_scale.backends.ds_zero import zero3_errors
from hdet_scale.config import HDETConfig
from hdet_scale.ds_json import loads_json_object
from hdet_scale.ds_keys import check_deepspeed_keys
from hdet_scale.ds_values import batch_errors, check_deepspeed_values
from hdet_scale.optimizers import client_built
from hdet_scale.ensemble import check_config
from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import require_regular
from hdet_scale.topology import Layout


def load_ds_config(config: str | dict) -> dict:
    """A copy of ``config``, or the JSON file it names. A key given twice in one object is
    refused, as DeepSpeed and ``hdet-train`` refuse it (``json`` would keep the last).

    Raises:
        HDETConfigError: a key given twice (naming the file and the key), a file holding
            another JSON value than an object, a ``config`` neither a path nor a mapping.
        OSError, ValueError: the file cannot be read, or is not JSON.
    """
    if isinstance(config, (str, os.PathLike)):
        require_regular(config, "DeepSpeed config")
        with open(config) as f:
            text = f.read()
        return loads_json_object(text, f"DeepSpeed config {os.fspath(config)!r}")
    if not isinstance(config, Mapping):  # None, a list: not a TypeError from dict()
        raise HDETConfigError(f"config: expected a DeepSpeed JSON path or a dict with its \"hdet\" block, got "
                              f"{type(config).__name__} {config!r:.100}")
    return copy.deepcopy(dict(config))


def prepare_config(ds_config: str | dict, world_size: int | None = None) -> tuple[HDETConfig, dict]:
    """Validate the ``"hdet"`` block against the rest of a DeepSpeed config, without
    communication. Returns ``(hdet_config, deepspeed_config_without_hdet)``.

    The DeepSpeed batch keys keep their global meaning: ``train_batch_size`` counts
    samples over all W ranks; since DeepSpeed's data-parallel group is the shard group,
    the returned config divides it by R.

    Unknown keys (:func:`hdet_scale.ds_keys.check_deepspeed_keys`): a top-level key
    that looks like ``"hdet"`` (``"hdett"``, ``"HDET"``) and keys DeepSpeed's own config
    models refuse raise; other keys DeepSpeed would ignore (a typo such as
    ``train_micro_batch_size_per_gpuu``, or another tool's field) are a ``UserWarning``
    naming the closest valid key.

    Raises:
        HDETConfigError: any invalid key, naming it: all problems of the ``hdet`` block
            at once, then (for a well-formed block) all DeepSpeed-key problems at once.
    """
    ds = load_ds_config(ds_config)
    check_deepspeed_keys(ds)
    check_deepspeed_values(ds)  # a negative LR or batch size, before DeepSpeed trains on it or asserts per rank
    block = ds.pop("hdet", None)
    # No block (or null): plain DeepSpeed, as if "enabled": false.
    cfg = HDETConfig.from_dict(block) if block is not None else HDETConfig(enabled=False)
    world = common_world_size() if world_size is None else world_size
    errors = []
    if cfg.enabled:
        try:
            Layout(world, cfg.replicas)
        except HDETConfigError as e:
            errors.append(str(e))
        if "scheduler" in ds:
            errors.append("scheduler: a DeepSpeed 'scheduler' block cannot be combined with hdet (two schedules "
                          "would fight over the LR); remove it and set hdet.schedule (name: onecycle, cosine or "
                          "constant; see docs/config.md)")
        opt_type, unknown = (ds.get("optimizer") or {}).get("type"), False
        if opt_type is not None and not client_built(ds):  # a name hdet_scale builds (engine_config.CLIENT_BUILT)
            # DeepSpeed's own test (engine._supported_optimizer): its names, case-insensitive,
            # or a torch.optim class; otherwise it asserts inside initialize, on every rank.
            # Checked only where DeepSpeed is installed (hdet-dryrun runs without it).
            try:
                from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
            except ImportError:
                DEEPSPEED_OPTIMIZERS = None
            unknown = DEEPSPEED_OPTIMIZERS is not None and (
                not isinstance(opt_type, str) or (opt_type.lower() not in DEEPSPEED_OPTIMIZERS
                                                  and getattr(torch.optim, opt_type, None) is None))
            if unknown:
                classes = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)]
                exact = [n for n in classes if isinstance(opt_type, str) and n.lower() == opt_type.lower()]
                # "AdamWW" gets a hint, and ZeRO's untested-optimizer line below would give
                # advice (zero_allow_untested_optimizer) that cannot help
                near = difflib.get_close_matches(opt_type, classes, n=1) if isinstance(opt_type, str) else []
                hint = (f"; DeepSpeed looks torch.optim classes up by their exact name: write {exact[0]!r}" if exact
                        else f"; did you mean {near[0]!r}?" if near else "")
                errors.append(f"optimizer.type: {opt_type!r} is neither a DeepSpeed optimizer "
                              f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor a torch.optim class{hint}")
        zero = zero3_errors(ds, cfg)  # what ZeRO-3 under HDET cannot run (backends/ds_zero.py)
        if unknown:  # ZeRO's word on an optimizer that does not exist: none
            zero = [e for e in zero if not e.startswith("optimizer.type:")]
        errors += zero
        # The batch keys are integers >= 1 here (check_deepspeed_values above); their product
        # over the whole world, with the keys left out derived as DeepSpeed derives them, is
        # the shared check's (ds_values.batch_errors).
        tbs = ds.get("train_batch_size")
        product = batch_errors(ds, world_size=world)
        errors += product
        if tbs is not None and not product and tbs % cfg.replicas:
            errors.append(f"train_batch_size: {tbs} (samples over all ranks) must be divisible by "
                          f"hdet.replicas={cfg.replicas}")
        elif tbs is not None and not product:
            ds["train_batch_size"] = tbs // cfg.replicas
    if errors:
        raise HDETConfigError("invalid DeepSpeed config for hdet:\n  " + "\n  ".join(errors))
    if cfg.enabled:
        check_config(cfg)
    return cfg, ds


def read_for_check(config: str | dict) -> Any:
    """``config`` (a path or an already-read dict) read as ``hdet-dryrun`` reads it: the
    library's reader (:func:`load_ds_config`: JSON, a key given twice
    refused) with a one-line :class:`HDETConfigError` for a file that is missing, empty,
    not UTF-8, not JSON or YAML by mistake. Returns the parsed
    value, which may not be a dict (the caller names that)."""
    try:
        return load_ds_config(config)
    except HDETConfigError:
        raise  # a key given twice: the message names the file and the key already
    except UnicodeDecodeError as e:  # random bytes in a .yaml are not called YAML
        raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: it is not UTF-8 text (byte {e.start}): is "
                              "it the right file?") from None
    except (OSError, ValueError, TypeError) as e:
        if _empty(config):  # an empty .yaml is not called YAML either
            raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: the file is empty; it must hold a "
                                  "DeepSpeed JSON object") from None
        raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: {e}{_yaml_hint(config, e)}") from None


def _empty(path: object) -> bool:
    """Whether the file ``path`` holds nothing but whitespace. Raises nothing."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):  # never a FIFO's open
        return False
    try:
        with open(path, "rb") as f:
            return not f.read(1 << 16).strip() and os.path.getsize(path) <= 1 << 16
    except OSError:
        return False


def _yaml_hint(path: object, error: Exception) -> str:
    """A hint when ``path`` failed as JSON and looks like YAML (by its name, or a first
    line ``key: ...``): most likely an ``hdet-train`` run config; empty otherwise."""
    if not isinstance(error, ValueError) or not isinstance(path, (str, os.PathLike)):
        return ""
    looks = os.fspath(path).endswith((".yaml", ".yml"))
    if not looks:
        try:
            with open(path, encoding="utf-8") as f:
                first = next((line for line in f if line.strip() and not line.lstrip().startswith("#")), "")
            looks = re.match(r"^[A-Za-z_][\w.-]*\s*:(\s|$)", first) is not None
        except (OSError, ValueError):
            return ""
    return ("; this looks like YAML (an hdet-train run config?); hdet-dryrun reads a DeepSpeed JSON (the file "
            "hdet-train's deepspeed_config= names)") if looks else ""
