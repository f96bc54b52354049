"""hdet_scale.hf_constructors: a model built by its class constructor inside
``hdet_scale.hf.zero_init`` is named (under ZeRO-3 it gets no transformers init: a first
loss of 29.9 against 4.17, measured); ``from_config`` and ``from_pretrained``
are not. The watch runs here without DeepSpeed: what it tells apart is how the model was
built, not where its parameters live (``hf_deepspeed.zero_init`` wraps zero.Init in it)."""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")

from hdet_scale.hf_constructors import watch_constructors  # noqa: E402


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8)


def _built(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch_constructors():
            build()
    return [str(w.message) for w in caught if "hdet_scale.hf.zero_init" in str(w.message)]


def test_a_class_constructor_is_named_once():
    said = _built(lambda: transformers.LlamaForCausalLM(_config()))
    assert len(said) == 1, said  # the inner LlamaModel's post_init is not named again
    assert "LlamaForCausalLM(config) was built by its class constructor" in said[0]
    assert "AutoModelForCausalLM.from_config(config)" in said[0]


def test_from_config_and_from_pretrained_say_nothing(tmp_path):
    assert _built(lambda: transformers.AutoModelForCausalLM.from_config(_config())) == []
    transformers.LlamaForCausalLM(_config()).save_pretrained(tmp_path)
    assert _built(lambda: transformers.LlamaForCausalLM.from_pretrained(tmp_path)) == []


def test_the_patch_ends_with_the_context_even_on_an_error():
    from transformers import PreTrainedModel

    before = {name: PreTrainedModel.__dict__[name] for name in ("post_init", "from_pretrained", "_from_config")}
    with pytest.raises(RuntimeError, match="the user's"):
        with watch_constructors():
            raise RuntimeError("the user's")
    assert {name: PreTrainedModel.__dict__[name] for name in before} == before
    assert _built(lambda: None) == []
