"""Rank workers for tests/distributed/test_sharded_init.py: the model built sharded
(DeepSpeed ``zero_init`` on the shard group, FSDP2 on the meta device) against the same
model built whole on every rank."""

from __future__ import annotations

MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, max_seq_len=32,
             tie_embeddings=False, init_seed=3)
HDET = {"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": 0.1}},
        "schedule": {"name": "constant", "total_steps": 10}, "auto": {"enabled": False}}


def _batch(seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (2, 17), generator=gen)
    return x[:, :-1], x[:, 1:]


def deepspeed_worker() -> dict:
    import deepspeed
    import torch
    # before zero_init opens, as its docstring asks: a class first defined inside loses
    # transformers >= 5.25's kernels decorator when DeepSpeed closes it (`whole` below)
    from transformers import LlamaForCausalLM  # noqa: F401

    import hdet_scale
    from hdet_scale.train.model import ModelConfig, build_model, loss_fn

    cfg = ModelConfig(**MODEL)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}, "hdet": HDET}
    topology = hdet_scale.build_topology(ds)
    mismatch = _error(lambda: hdet_scale.zero_init(topology, {**ds, "hdet": {**HDET, "replicas": 4}}))
    with hdet_scale.zero_init(topology, ds):
        model = build_model(cfg)
    # What each rank holds after construction: its partition only.
    held = {n: (p.ds_tensor.numel(), p.ds_numel, p.numel()) for n, p in model.named_parameters()}
    engine, _, _, _ = hdet_scale.initialize(model, ds, model_parameters=model.parameters(), topology=topology)
    whole = build_model(cfg)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        diff = max(float((p.detach() - q).abs().max()) for p, q in
                   zip(engine.module.parameters(), whole.parameters()))
    x, y = _batch()
    with torch.no_grad():
        losses = (float(loss_fn(engine, x, y)), float(loss_fn(whole, x, y)))
    return {"held": held, "max_diff": diff, "losses": losses, "shard_size": topology.shard_size,
            "mismatch": mismatch}


def _error(fn) -> str | None:
    """The HDETConfigError message ``fn()`` raises (None if it does not)."""
    from hdet_scale.errors import HDETConfigError

    try:
        fn()
    except HDETConfigError as e:
        return str(e)
    return None


def fsdp2_worker(gradient_sharing: str) -> dict:
    import torch

    from hdet_scale.backends import fsdp2
    from hdet_scale.train.model import ModelConfig, build_model, init_model_weights, loss_fn

    cfg = ModelConfig(**MODEL)
    hdet = {**HDET, "gradient_sharing": gradient_sharing}
    topology = fsdp2.build_topology(hdet)
    model = build_model(cfg, params_on_meta=True)
    meta = all(p.is_meta for p in model.parameters())
    opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    # Refused before any collective, on every rank: a layout other than the config's, a
    # meta-device model with nothing to fill it.
    mismatch = _error(lambda: fsdp2.initialize(model, {**hdet, "replicas": 4}, opt, topology=topology,
                                               init_weights=lambda m: init_model_weights(m, cfg)))
    no_init = _error(lambda: fsdp2.initialize(model, hdet, opt, topology=topology))
    model, _, _ = fsdp2.initialize(model, hdet, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                   shard_modules=lambda m: m.model.layers, topology=topology,
                                   init_weights=lambda m: init_model_weights(m, cfg))
    local = sum(p.to_local().numel() for p in model.parameters())
    whole = build_model(cfg)
    diff = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), whole.parameters()))
    buffers = max(float((a - b).abs().max()) for a, b in zip(model.buffers(), whole.buffers()))
    x, y = _batch()
    with torch.no_grad():
        losses = (float(loss_fn(model, x, y)), float(loss_fn(whole, x, y)))
    return {"meta": meta, "local": local, "full": sum(p.numel() for p in whole.parameters()), "max_diff": diff,
            "buffer_diff": buffers, "losses": losses, "mismatch": mismatch, "no_init": no_init}
