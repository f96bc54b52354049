"""Unknown and misspelled keys in a DeepSpeed config, found with DeepSpeed's own parser.

DeepSpeed ignores a top-level key it does not read (``train_micro_batch_size_per_gpuu``,
``"hdett"``), so a typo silently keeps a default for a whole run; its pydantic blocks
(``zero_optimization``, ``fp16``, ``bf16``...) refuse unknown keys, but only inside
``deepspeed.initialize``, as a traceback on every rank. This module parses a copy of
the config with ``deepspeed.runtime.config.DeepSpeedConfig`` through a mapping that
records every key the parser asks for: a key present and never asked for is unknown,
the asked-for keys are the valid ones (the closest is suggested, ``difflib``). A block
handed whole to a pydantic model is checked by that model (``extra="forbid"``); its
``ValidationError`` is turned into one line per key. ``optimizer.params`` go to the
optimizer's constructor, so they are compared with its signature.

What the caller does with the findings (:func:`check_deepspeed_keys`):

- a top-level key that looks like ``"hdet"`` (``"hdett"``, ``"HDET"``, ``"hdet_config"``)
  is always an error: the user meant HDET and would silently get plain data parallelism;
- keys DeepSpeed itself refuses (its pydantic blocks, removed features) are always
  errors: ``deepspeed.initialize`` would fail on them anyway, later and on every rank;
- so is a block of settings given as another value (``"bf16": true``,
  ``"zero_optimization": 5``), which DeepSpeed fails on with a TypeError naming no key:
  the line names the key and the form (:func:`hdet_scale.ds_models.object_line`). A
  top-level key is such a block where DeepSpeed parses ``{}`` there and fails on the
  value, each parsed alone;
- other unknown keys are errors with ``strict=True`` (``hdet-train``, ``hdet-dryrun``) and
  warnings otherwise (the library). A user's DeepSpeed JSON is often shared with other
  tools (launch scripts, the Hugging Face Trainer, a team's own fields), and DeepSpeed
  accepts such keys; refusing them in ``hdet_scale.initialize`` would break configs
  that run with plain DeepSpeed.

Without DeepSpeed installed (an FSDP2 / DDP user, ``hdet-dryrun``) the same checks run
on a snapshot of what DeepSpeed's parser reads, shipped with the package
(:mod:`hdet_scale.ds_schema`: what it does not reproduce is said there). Deeper levels of non-pydantic blocks that DeepSpeed reads
conditionally (e.g. ``data_efficiency.data_sampling.*``) are checked only where the
parser reached them.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import logging
import typing
import warnings
from collections.abc import KeysView, Mapping
from typing import Any

from hdet_scale import ds_models
from hdet_scale.ds_values import optimizer_accepts
from hdet_scale.errors import HDETConfigError

HDET_KEY = "hdet"
# Batch keys are checked by hdet_scale itself (their meaning changes with R); the trial
# parse replaces them by a consistent set so that DeepSpeed's batch assertion, which needs
# the real world size, cannot fail there.
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Top-level keys DeepSpeed reads outside DeepSpeedConfig._initialize_params (deepspeed
# 0.19: deepspeed/__init__.py initialize() and DeepSpeedConfig.__init__ with an mpu).
_READ_ELSEWHERE = ("sequence_parallel_size", "data_parallel_size")
# Nodes DeepSpeed looks into for one key but hands on whole: checked against the
# optimizer's constructor below (scheduler params: the scheduler's, rejected with hdet).
_OWN_CHECK = ("optimizer.params.", "scheduler.params.")


def looks_like_hdet(key: Any) -> bool:
    """A top-level key the user most likely meant as the ``"hdet"`` block: any case of
    it, a name containing it (``hdet_config``), or one edit or so away (``hdett``, ``hdt``)."""
    if not isinstance(key, str) or key == HDET_KEY:
        return False
    k = key.lower()
    return HDET_KEY in k or bool(difflib.get_close_matches(k, [HDET_KEY], n=1, cutoff=0.75))


def closest(key: str, valid: typing.Iterable[str]) -> str | None:
    """The valid key closest to ``key`` (``difflib``, case-insensitive), or ``None``."""
    valid = sorted({v for v in valid if isinstance(v, str)})
    lower = {v.lower(): v for v in valid}
    match = difflib.get_close_matches(str(key).lower(), list(lower), n=1, cutoff=0.6)
    if match:
        return lower[match[0]]
    initials = "".join(w[:1] for w in str(key).lower().split("_"))  # learning_rate -> lr
    return lower.get(initials) if "_" in str(key) else None


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    best = closest(key, valid)
    return f"did you mean {best!r}?" if best else f"valid keys: {', '.join(sorted(valid))}"


class _Recorder(dict):
    """A dict that records the keys looked up in it (``get``, ``[]``, ``in``, ``in
    keys()``); nested dicts are returned as recorders too. Iterating it (``items()``,
    ``**`` unpacking) marks it *consumed*: whoever iterated it took every key, so only
    a node that was looked up key by key and never iterated tells unknown keys apart."""

    def __init__(self, data: Mapping, path: str = "") -> None:
        super().__init__(data)
        self.path = path
        self.seen: set = set()
        self.consumed = False
        self.children: dict[Any, _Recorder] = {}

    def _child(self, key: Any, value: Any) -> Any:
        if isinstance(value, dict) and not isinstance(value, _Recorder):
            if key not in self.children:
                self.children[key] = _Recorder(value, f"{self.path}{key}.")
            return self.children[key]
        return value

    def __copy__(self) -> "_Recorder":
        return self  # DeepSpeedConfig copies its input: keep recording on the same node

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return self._child(key, super().__getitem__(key))

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return self[key] if dict.__contains__(self, key) else default

    def __contains__(self, key: Any) -> bool:
        self.seen.add(key)
        return dict.__contains__(self, key)

    def __iter__(self):
        self.consumed = True
        return dict.__iter__(self)

    def keys(self) -> KeysView:
        return _RecordingKeys(self)

    def items(self):
        self.consumed = True
        return dict.items(self)

    def values(self):
        self.consumed = True
        return dict.values(self)

    def nodes(self) -> typing.Iterator["_Recorder"]:
        yield self
        for child in self.children.values():
            yield from child.nodes()


class _RecordingKeys(KeysView):
    def __contains__(self, key: Any) -> bool:
        return key in self._mapping

    def __iter__(self):
        self._mapping.consumed = True
        return dict.__iter__(self._mapping)


@contextlib.contextmanager
def _quiet():
    # The trial parse repeats what deepspeed.initialize will log (world size, deprecated
    # fields): keep it out of the user's output.
    log = logging.getLogger("DeepSpeed")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _deepspeed_config_class() -> Any:
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return None
    return DeepSpeedConfig


@functools.lru_cache(maxsize=1)
def valid_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed's config parser reads (asked for while parsing a
    minimal config), plus the few read elsewhere and ``"hdet"``. Without DeepSpeed: the
    shipped snapshot's (:mod:`hdet_scale.ds_schema`). Empty if this DeepSpeed cannot
    parse the minimal config (then nothing is checked)."""
    cls = _deepspeed_config_class()
    if cls is None:
        from hdet_scale import ds_schema

        return frozenset(ds_schema.load()["top_level"])
    rec = _Recorder({"train_micro_batch_size_per_gpu": 1})
    try:
        with _quiet():
            cls(rec)
    except Exception:  # another DeepSpeed than this module knows: check nothing rather than everything
        return frozenset()
    return frozenset(k for k in rec.seen if isinstance(k, str)) | set(_READ_ELSEWHERE) | {HDET_KEY}


def _alone(cls: Any, key: str, value: Any) -> tuple[Exception | None, _Recorder]:
    """Parse a minimal config with ``key: value``: what DeepSpeed raised (or ``None``)
    and the recorder."""
    rec = _Recorder({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                     key: copy.deepcopy(value)})
    try:
        with _quiet():
            cls(rec)
    except Exception as e:
        return e, rec
    return None, rec


def _not_objects(cls: Any, ds: Mapping, valid: frozenset, prefix: str) -> dict[Any, str]:
    """``{key: message}`` for the top-level keys DeepSpeed reads as a block of settings
    (it parses ``{}`` there, looking into it or validating it as a pydantic model) that
    hold something it fails on, each parsed alone: inside ``initialize`` a bare TypeError
    or AttributeError naming no key. A non-object form DeepSpeed still takes
    (``"zero_optimization": true``, deprecated) is left alone."""
    found = {}
    for k, v in ds.items():
        if isinstance(v, Mapping) or k not in valid or k == HDET_KEY or k in _BATCH_KEYS:
            continue
        failed, _ = _alone(cls, k, v)
        if failed is None or type(failed).__name__ == "DeepSpeedConfigError":  # removed: _parse says so
            continue
        empty_failed, rec = _alone(cls, k, {})
        node = rec.children.get(k)
        looked_into = node is not None and (node.consumed or bool(node.seen))  # {} read as a block
        typed = any(err.get("type") in ("model_type", "dict_type") for err in ds_models.pydantic_errors(failed))
        if empty_failed is None and (looked_into or typed):
            seen = {s for s in node.seen if isinstance(s, str)} if node is not None else set()
            found[k] = ds_models.object_line(f"{prefix}{k}", v, seen | ds_models.model_fields(failed))
    return found


def find_problems(ds: Mapping, optimizer_params: bool = True, prefix: str = ""
                  ) -> tuple[list[str], list[str], list[str]]:
    """Look for unknown keys in the DeepSpeed config ``ds`` (a whole config, possibly
    with an ``"hdet"`` block, which is not looked into here). Pure, no communication.

    Returns ``(hdet_like, refused, unknown)``, one line per finding, each starting with
    ``prefix`` and the dotted key: the ``"hdet"`` look-alikes; what DeepSpeed's config
    models refuse (and an optimizer block without a type); keys DeepSpeed would silently
    ignore (and, without a key, a parse DeepSpeed gave up on for another reason).
    ``optimizer_params``: compare ``optimizer.params`` with the constructor DeepSpeed will
    call (off for backends that build a torch optimizer themselves and check it their own way).
    """
    opt = ds.get("optimizer")
    if not isinstance(opt, Mapping) or isinstance(opt.get("type"), str):
        return _find_problems(ds, optimizer_params, prefix)
    # DeepSpeed reads optimizer.params only through the type (get_optimizer_params) and
    # calls .lower() on it: a parse with this block would call the params unknown (sending
    # the user to the wrong key) or stop naming no key (a number).
    hdet_like, refused, unknown = _find_problems({k: v for k, v in ds.items() if k != "optimizer"},
                                                 optimizer_params, prefix)
    if opt.get("type") is None:
        refused.append(f"{prefix}optimizer: has no \"type\"; DeepSpeed reads an optimizer block only through its "
                       "type and would ignore this one, params included: name the optimizer's class, e.g. "
                       "\"type\": \"AdamW\"")
    else:
        refused.append(f"{prefix}optimizer.type: expected the optimizer's class name as a string, e.g. \"AdamW\", "
                       f"got {opt['type']!r}")
    return hdet_like, refused, unknown


def _find_problems(ds: Mapping, optimizer_params: bool, prefix: str) -> tuple[list[str], list[str], list[str]]:
    """The lines of :func:`find_problems`, an optimizer block without a type aside."""
    hdet_like = [f"{prefix}{k}: not a key of DeepSpeed or hdet_scale; did you mean 'hdet'? hdet_scale reads the "
                 "block named exactly 'hdet'" + ("" if HDET_KEY in ds else
                                                 ": without it this config trains plain DeepSpeed, without HDET")
                 for k in ds if looks_like_hdet(k)]
    refused: list[str] = []
    unknown: list[str] = []
    cls = _deepspeed_config_class()
    valid = valid_top_level_keys()
    if cls is None:  # no DeepSpeed (an FSDP2 / DDP user): the same lines from the shipped snapshot
        from hdet_scale import ds_schema

        refused, unknown = ds_schema.offline_problems(ds, prefix)
        return hdet_like, refused, unknown + _optimizer_params(ds, optimizer_params, prefix, valid)
    if not valid:
        return hdet_like, refused, unknown
    not_objects = _not_objects(cls, ds, valid, prefix)
    refused.extend(not_objects.values())
    trial = copy.deepcopy({k: v for k, v in ds.items()
                           if k in valid and k != HDET_KEY and k not in _BATCH_KEYS and k not in not_objects})
    trial.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    rec = _parse(cls, trial, refused, unknown, prefix)
    valid = valid | (rec.seen if rec is not None else set())
    for k in ds:
        if k not in valid and not looks_like_hdet(k):
            unknown.append(f"{prefix}{k}: unknown DeepSpeed key (DeepSpeed would ignore it); {_suggest(str(k), valid)}")
    for node in rec.nodes() if rec is not None else ():
        if node is rec or node.consumed or not node.seen or node.path in _OWN_CHECK:
            continue  # the root: checked above; iterated or never looked into: not ours to judge
        for k in node:
            if k not in node.seen:
                unknown.append(f"{prefix}{node.path}{k}: unknown DeepSpeed key (DeepSpeed would ignore it); "
                               f"{_suggest(str(k), {s for s in node.seen if isinstance(s, str)})}")
    return hdet_like, refused, unknown + _optimizer_params(ds, optimizer_params, prefix, valid)


def _optimizer_params(ds: Mapping, optimizer_params: bool, prefix: str, valid: frozenset) -> list[str]:
    """The lines for ``optimizer.params`` the optimizer DeepSpeed builds does not take."""
    found = optimizer_accepts(ds) if optimizer_params and valid else None
    params = ds["optimizer"].get("params") if found is not None else None
    if not isinstance(params, Mapping):
        return []
    what, accepted = found
    who = "hdet_scale" if what.startswith("schedulefree.") else "DeepSpeed"  # a name DeepSpeed does not know
    return [f"{prefix}optimizer.params.{k}: not an argument of {what} (the optimizer {who} builds for type "
            f"{ds['optimizer']['type']!r}); {_suggest(str(k), accepted)}" for k in params if k not in accepted]


def _parse(cls: Any, trial: dict, refused: list[str], unknown: list[str], prefix: str) -> _Recorder | None:
    """Parse ``trial`` with DeepSpeedConfig, turning each pydantic error into a line of
    ``refused`` and dropping the key to find the next; the recorder of the first clean
    parse, or ``None`` when DeepSpeed stopped on something else (its message goes to
    ``unknown``: an error where every unknown key is, a warning in the library, since it
    may come from this trial parse's stand-in batch keys rather than from the user)."""
    from pydantic import ValidationError

    models = None
    for _ in range(50):  # one pass per offending key at most; bounded for safety
        rec = _Recorder(trial)
        try:
            with _quiet():
                cls(rec)
            return rec
        except ValidationError as e:
            models = models or ds_models.pydantic_models()
            model = models.get(e.title)
            dropped = False
            for err in e.errors():
                loc = tuple(err.get("loc", ()))
                path = ds_models.find_block(trial, model, loc) if model is not None else None
                key = prefix + (path or "") + ".".join(str(p) for p in loc)
                if err.get("type") in ("model_type", "dict_type"):  # a block given as a value
                    sub_fields = ds_models.model_keys(models.get(err.get("ctx", {}).get("class_name")))
                    refused.append(ds_models.object_line(key, err.get("input"), sub_fields))
                elif err.get("type") == "extra_forbidden" and model is not None:
                    sub: Any = model
                    for part in loc[:-1]:
                        sub = ds_models.sub_model(sub, part) if sub is not None else None
                    hint = _suggest(str(loc[-1]), ds_models.model_keys(sub)) if sub is not None else "not a valid key"
                    refused.append(f"{key}: unknown key, DeepSpeed refuses it; {hint}")
                else:
                    refused.append(f"{key}: DeepSpeed refuses the value {err.get('input')!r}: {err.get('msg')}")
                if path is not None:
                    dropped = ds_models.drop(trial, path, loc) or dropped
            if not dropped:
                return None
        except Exception as e:
            if type(e).__name__ == "DeepSpeedConfigError":  # a removed feature's block: certain
                refused.append(f"{prefix.rstrip('.') or 'config'}: DeepSpeed refuses it: {e}")
            else:  # its assertions, which may be about the stand-in batch keys
                unknown.append(f"DeepSpeed's config parser stops on this config ({type(e).__name__}: {e})")
            return None
    return None


#: Past this many unknown keys the file is likely no DeepSpeed config: the first
#: :data:`_SHOWN` lines in full, the rest by name.
_MANY, _SHOWN = 10, 3


def _at_most(unknown: list[str], ds: Mapping) -> list[str]:
    """The first :data:`_SHOWN` lines, then one naming the rest (a run's summary.json
    given as the DeepSpeed config would otherwise print 25 KB, one line per key)."""
    if len(unknown) <= _MANY:
        return unknown
    rest = [line.split(":", 1)[0] for line in unknown[_SHOWN:]]
    hint = "" if any(k in ds for k in ("hdet", "zero_optimization", "optimizer", "train_micro_batch_size_per_gpu")) \
        else "; this file has no hdet, optimizer, zero_optimization or batch key: is it a DeepSpeed config?"
    return unknown[:_SHOWN] + [f"and {len(rest)} more unknown keys: {', '.join(rest)}{hint}"]


def hf_model_type(ds: Mapping) -> str | None:
    """The ``model_type`` of a Hugging Face model ``config.json`` given where a DeepSpeed
    config belongs (``"?"`` when it has none but ``transformers_version``); ``None`` for
    anything holding a key of DeepSpeed's parser or the hdet block."""
    if not any(k in ds for k in ("model_type", "transformers_version", "architectures")):
        return None
    if any(k in valid_top_level_keys() or k == HDET_KEY for k in ds):
        return None
    return str(ds.get("model_type", "?"))


def check_deepspeed_keys(ds: Mapping, strict: bool = False, prefix: str = "",
                         optimizer_params: bool = True) -> list[str]:
    """Refuse or warn about unknown keys of the DeepSpeed config ``ds`` (see the module
    docstring for the policy). ``prefix`` is put before every key (the trainer's
    ``deepspeed.``). Returns the lines that were only warned about.

    Raises:
        HDETConfigError: an ``"hdet"`` look-alike, a key or value DeepSpeed's config
            models refuse, or (``strict``) any other finding; all of them in one message.
    """
    if not isinstance(ds, Mapping):
        return []
    model_type = hf_model_type(ds)
    if model_type is not None:  # one line, not 30 unknown keys
        raise HDETConfigError(f"invalid DeepSpeed config: {prefix or 'this file'} is a Hugging Face model config "
                              f"(model_type {model_type!r}), not a DeepSpeed config (optimizer, zero_optimization, "
                              "batch keys, the hdet block)")
    hdet_like, refused, unknown = find_problems(ds, optimizer_params, prefix)
    errors = hdet_like + refused + (_at_most(unknown, ds) if strict else [])
    if errors:
        raise HDETConfigError("invalid DeepSpeed config:\n  " + "\n  ".join(errors))
    for line in unknown:
        warnings.warn(f"hdet_scale: {line}", UserWarning, stacklevel=2)  # one location: shown once per process
    return unknown
