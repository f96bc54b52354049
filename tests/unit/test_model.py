"""Unit tests for hdet_scale.train.model (byte-level Llama)."""

from __future__ import annotations

import math

import pytest
import torch

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.model import ModelConfig, build_model, loss_fn, param_count

# A smaller config keeps the tests fast; the default is checked once below.
_SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
              intermediate_size=64, max_seq_len=32)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _expected_param_count(c: ModelConfig) -> int:
    head_dim = c.hidden_size // c.num_heads
    attn = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_kv_heads * head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    norms = 2 * c.hidden_size
    emb = 256 * c.hidden_size
    head = 0 if c.tie_embeddings else 256 * c.hidden_size
    return emb + head + c.num_layers * (attn + mlp + norms) + c.hidden_size


def test_default_config_param_count_and_forward_shape():
    cfg = ModelConfig()
    model = build_model(cfg)
    assert param_count(model) == _expected_param_count(cfg) == 836_736
    x = torch.randint(0, 256, (2, cfg.max_seq_len))
    with torch.no_grad():
        logits = model(input_ids=x).logits
    assert logits.shape == (2, cfg.max_seq_len, 256)
    assert model.config.vocab_size == 256
    assert model.config.rope_parameters["rope_theta"] == cfg.rope_theta


def test_untied_and_gqa_param_count():
    cfg = ModelConfig(**_SMALL, tie_embeddings=False)
    model = build_model(cfg)
    assert param_count(model) == _expected_param_count(cfg)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    tied = build_model(ModelConfig(**_SMALL))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_same_seed_identical_params_different_seed_different():
    a = _params(build_model(ModelConfig(**_SMALL, init_seed=3)))
    b = _params(build_model(ModelConfig(**_SMALL, init_seed=3)))
    c = _params(build_model(ModelConfig(**_SMALL, init_seed=4)))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    random_keys = [k for k in a if "norm" not in k]  # norms init to ones
    assert random_keys
    assert all(not torch.equal(a[k], c[k]) for k in random_keys)


def test_build_model_leaves_global_rng_unchanged():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    build_model(ModelConfig(**_SMALL, init_seed=99))
    assert torch.equal(before, torch.random.get_rng_state())
    # and the init does not depend on the caller's RNG state
    torch.manual_seed(1)
    a = _params(build_model(ModelConfig(**_SMALL)))
    torch.manual_seed(2)
    b = _params(build_model(ModelConfig(**_SMALL)))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_untrained_loss_near_ln256_and_backward():
    model = build_model(ModelConfig(**_SMALL))
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 256, (4, 33), generator=g)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    loss = loss_fn(model, inputs, targets)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_loss_fn_matches_manual_cross_entropy():
    model = build_model(ModelConfig(**_SMALL))
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 256, (2, 8), generator=g)
    targets = torch.randint(0, 256, (2, 8), generator=g)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        manual = -logp.gather(-1, targets[..., None]).mean()
        assert loss_fn(model, inputs, targets).item() == pytest.approx(manual.item(), rel=1e-5)


def test_loss_fn_on_bf16_model_is_fp32():
    model = build_model(ModelConfig(**_SMALL)).to(torch.bfloat16)
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        loss = loss_fn(model, x, x)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(hidden_size=30, num_heads=4), "model.hidden_size"),
        (dict(num_heads=4, num_kv_heads=3), "model.num_heads"),
        (dict(num_layers=0), "model.num_layers"),
        (dict(dropout=1.0), "model.dropout"),
    ],
)
def test_bad_model_config_names_key(override, key):
    with pytest.raises(HDETConfigError, match=key):
        build_model(ModelConfig(**override))
