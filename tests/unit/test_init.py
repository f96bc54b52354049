"""The trainer's shard-independent init (hdet_scale/train/init.py)."""

from __future__ import annotations

import torch

from hdet_scale.train import init
from hdet_scale.train.model import ModelConfig, build_model


def test_any_range_is_the_slice_of_the_whole_draw(monkeypatch):
    # Small blocks so that ranges cross block boundaries; every (start, stop) a shard could
    # hold must read the same values as the whole tensor's draw at those indices.
    monkeypatch.setattr(init, "BLOCK", 64)
    whole = init._draw(7, "w", 1000, 0, 1000, 0.02)
    for start, stop in ((0, 1), (63, 65), (100, 612), (960, 1000), (500, 500)):
        assert torch.equal(init._draw(7, "w", 1000, start, stop, 0.02), whole[start:stop])
    # another name or seed is another stream
    assert not torch.equal(init._draw(8, "w", 1000, 0, 1000, 0.02), whole)
    assert not torch.equal(init._draw(7, "v", 1000, 0, 1000, 0.02), whole)
    assert abs(float(whole.std()) - 0.02) < 0.002


def test_the_model_init_is_llamas_distribution_and_a_function_of_the_seed():
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48,
                      max_seq_len=16, init_seed=5)
    a, b = build_model(cfg), build_model(cfg)
    c = build_model(ModelConfig(**{**cfg.__dict__, "init_seed": 6}))
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert not torch.equal(p, r), name
            assert 0.015 < float(p.std()) < 0.025, name


def test_params_on_meta_keeps_the_buffers():
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48,
                      max_seq_len=16)
    meta = build_model(cfg, params_on_meta=True)
    whole = build_model(cfg)
    assert all(p.is_meta for p in meta.parameters())
    for (name, x), y in zip(meta.named_buffers(), whole.buffers()):
        assert not x.is_meta and torch.equal(x, y), name
