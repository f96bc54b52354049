"""The ``key=value`` overrides of ``hdet-train``, each parsed alone so that every error
names its override (``config.load_run_config`` merges them over the YAML). Pure."""

from __future__ import annotations

from typing import Any

import yaml

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.config_files import OCTAL, YAML11_BOOLS, ambiguous


def parse_overrides(overrides: list[str]) -> tuple[Any, dict]:
    """The ``key=value`` overrides as one OmegaConf node and as a plain dict
    (interpolations unresolved). Each is parsed alone, so that every error names its
    override: a value that is not YAML (``train.steps=[1,``), a section given as a value
    (``train=[1,2]``, the line of ``config.check_sections``), a key given twice
    (``train.steps=5 train.steps=7``; refused as Hydra does, rather than keeping the
    last silently) and a key set both as a value and inside it (``deepspeed.hdet=5
    deepspeed.hdet.replicas=2``: OmegaConf's result depends on the order)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from hdet_scale.train.config import check_sections, option_message  # config.py imports this module

    if any(o in ("-h", "--help") for o in overrides):
        raise HDETConfigError("--help goes first (hdet-train --help); overrides are key=value, e.g. train.steps=10")
    dashed = [o for o in overrides if o.startswith("-")]
    if dashed:
        raise HDETConfigError(option_message(dashed[0]))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        yaml_late = [o for o in bad if o.endswith((".yaml", ".yml"))]
        first = (f"; a config file goes first: hdet-train {yaml_late[0]} key=value ..."
                 if yaml_late else "")
        raise HDETConfigError(f"overrides must be key=value (e.g. train.steps=10), got {bad}{first}")
    spaced = next((o for o in overrides if o.split("=", 1)[0] != o.split("=", 1)[0].strip()), None)
    if spaced is not None:  # "train.steps = 30" is not "train.steps : unknown key"
        key, value = (part.strip() for part in spaced.split("=", 1))
        raise HDETConfigError(f"override {spaced!r}: spaces around the key; write {key}={value} (no spaces around "
                              "'=')")
    # "=5" would read as the key '' of the config, "train..steps=5" as "train"
    bad = [o for o in overrides if not all(o.split("=", 1)[0].split("."))]
    if bad:
        raise HDETConfigError(f"override {bad[0]!r}: the key before '=' must be dotted names without an empty part "
                              "(e.g. train.steps=10)")
    nodes, setters = [], {}  # setters: dotted key -> the override that sets it
    for o in overrides:
        key, value = o.split("=", 1)
        try:
            node = OmegaConf.from_dotlist([o])
        except (yaml.YAMLError, ValueError, OmegaConfBaseException) as e:
            why = " ".join(str(getattr(e, "problem", None) or e).splitlines()[0].split())
            raise HDETConfigError(f"override {o!r}: the value {value!r} of {key} is not a valid YAML value ({why}); "
                                  "quote it for a string, e.g. 'run_dir=\"a,b\"'") from None
        tree = OmegaConf.to_container(node, resolve=False)
        if value.strip().lower() in YAML11_BOOLS and isinstance(OmegaConf.select(node, key.strip()), bool):
            # train.overwrite=yes would replace a run; the docs promise true/false only
            raise HDETConfigError(f"override {o!r}: write true or false ({value.strip()!r} is YAML 1.1's spelling "
                                  f"of a boolean, which hdet-train does not take), or quote a string: "
                                  f"'{key.strip()}=\"{value.strip()}\"'")
        if OCTAL.fullmatch(value.strip()) and isinstance(OmegaConf.select(node, key.strip()), int):
            # train.steps=010 would train 8 steps (YAML 1.1 octal)
            raise HDETConfigError(f"override {o!r}: {ambiguous(value)}; write the number without the leading 0")
        check_sections(tree, "", yaml_form=False)
        for leaf in _leaves(tree):
            if leaf in setters:
                raise HDETConfigError(f"multiple values for {leaf}: {setters[leaf]!r} and {o!r}; keep one")
            parts = leaf.split(".")
            outer = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in setters), None)
            inner = next((k for k in setters if k.startswith(leaf + ".")), None)
            if outer is not None or inner is not None:
                (value_by, whole), inside_by = (((setters[outer], outer), o) if outer is not None
                                                else ((o, leaf), setters[inner]))
                raise HDETConfigError(f"{value_by!r} sets {whole} to a single value and {inside_by!r} sets a key "
                                      f"inside it: keep one")
            setters[leaf] = o
        nodes.append(node)
    merged = OmegaConf.merge(OmegaConf.create(), *nodes)
    return merged, OmegaConf.to_container(merged, resolve=False)




def _leaves(tree: Any, path: str = "") -> list[str]:
    """The dotted keys an override's value sets: a non-empty mapping sets its keys, any
    other value (a list too) the key itself."""
    if isinstance(tree, dict) and tree:
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{path}{k}.")]
    return [] if isinstance(tree, dict) else [path[:-1]]
