"""Size keys of a Hugging Face config that make a degenerate causal LM (``hdet-dryrun
--hf-config``): below 1, transformers either builds a model without layers, vocabulary
or MLP, or fails with an error that names no key.
"""

from __future__ import annotations

from typing import Any

#: Size keys of a Hugging Face config that must be at least 1, each with what a causal LM
#: needs it for. Unchecked, ``num_hidden_layers=0, vocab_size=0`` builds a 64-parameter
#: "model" (the final norm) and the dry run costs it with exit 0; transformers builds a
#: model from 0 (and from negative) layers, vocabulary, MLP width (``intermediate_size``,
#: GPT-2's ``n_inner``, OPT's ``ffn_dim``), Mistral's ``head_dim`` and GPT-2's
#: ``n_positions``, and fails on the others with a ZeroDivisionError that names no key.
#: GPT-2 / BLOOM spellings (``n_layer``, ``n_embd``, ...) come from the config class's
#: ``attribute_map``. Mixture-of-experts counts are left out: some families write 0 there
#: for a dense layer.
HF_SIZE_KEYS = {
    "num_hidden_layers": "at least 1 layer",
    "vocab_size": "a vocabulary of at least 1 token",
    "hidden_size": "a hidden size of at least 1",
    "num_attention_heads": "at least 1 attention head",
    "num_key_value_heads": "at least 1 key/value head",
    "head_dim": "a head dimension of at least 1",
    "intermediate_size": "an MLP width of at least 1",
    "n_inner": "an MLP width of at least 1",
    "ffn_dim": "an MLP width of at least 1",
    "max_position_embeddings": "at least 1 position",
}


def degenerate_size_keys(config: dict, model_type: Any) -> list[tuple[str, Any, str]]:
    """``(key, value, need)`` for each key of ``config`` (a Hugging Face config's dict, in
    its file's order) that is in :data:`HF_SIZE_KEYS`, or an alias of one, and holds a
    number below 1. Other types are left to transformers' own validation."""
    try:
        from transformers import CONFIG_MAPPING

        aliases = {alias: name for name, alias in CONFIG_MAPPING[model_type].attribute_map.items()}
    except Exception:  # noqa: BLE001 - an unknown model_type is refused by AutoConfig, with its list
        aliases = {}
    return [(key, value, HF_SIZE_KEYS[aliases.get(key, key)]) for key, value in config.items()
            if aliases.get(key, key) in HF_SIZE_KEYS and isinstance(value, (int, float))
            and not isinstance(value, bool) and value < 1]


def join_and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
