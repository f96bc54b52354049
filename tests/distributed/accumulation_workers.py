"""Rank workers for tests/distributed/test_accumulation.py: ``hdet-train``'s loop (the
real ``train``) run several times in one launch, with what the test needs to see that
the runs computed the same steps: the backward passes the model went through, counted
by a hook on the model itself (independent of the engine's own counter), and the final
weights, gathered whole."""

from __future__ import annotations

from typing import Any


def _backward_counter(model: Any, seen: dict) -> None:
    # The final RMSNorm sits outside the decoder layers, so activation checkpointing
    # does not re-run it: its backward hook fires once per backward pass of the model.
    def count(*_: Any) -> None:
        seen["model_backward_passes"] += 1

    seen["model_backward_passes"] = 0
    model.model.norm.register_full_backward_hook(count)


def _layer_forwards(model: Any, seen: dict) -> None:
    # A module inside decoder layer 0: it runs again when activation checkpointing
    # recomputes the layer in the backward pass. Counted with gradients on only (not in
    # evaluation or probe forwards), before it runs: torch's non-reentrant recompute
    # stops early once it has the saved tensors, before the module's forward returns.
    import torch

    def count(*_: Any) -> None:
        seen["layer_forwards"] += int(torch.is_grad_enabled())

    seen["layer_forwards"] = 0
    model.model.layers[0].mlp.register_forward_pre_hook(count)


def _final_weights(engine: Any) -> Any:
    """Every parameter whole, flattened in name order, as float64 numpy (collective on
    ZeRO-3 and FSDP2: every rank calls it)."""
    import numpy as np

    if engine.backend == "deepspeed":
        import deepspeed

        module = engine.model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            named = {n: p.detach().double().clone() for n, p in module.named_parameters()}
    else:
        from torch.distributed.tensor import DTensor

        named = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().clone()
                 for n, p in engine._module.named_parameters()}
    return np.concatenate([named[n].reshape(-1).cpu().numpy() for n in sorted(named)])


def train_runs(runs: list[dict]) -> list[dict]:
    """``hdet_scale.train.loop.train`` for each resolved run config in turn, on this rank.
    Per run: the summary, the model's backward passes and layer-0 forwards with
    gradients on (hooks), DeepSpeed's own step counters (deepspeed only), and on rank 0
    the final weights (numpy float64)."""
    import torch.distributed as dist

    from hdet_scale.train import loop
    from hdet_scale.train.engines import build_engine

    out = []
    for run in runs:
        seen: dict = {}

        def capture(*args: Any, seen: dict = seen, **kwargs: Any) -> Any:
            # The real engine; only a reference to it is kept, and counting hooks added.
            engine = seen["engine"] = build_engine(*args, **kwargs)
            module = engine.model.module if engine.backend == "deepspeed" else engine._module
            _backward_counter(module, seen)
            _layer_forwards(module, seen)
            return engine

        loop.build_engine = capture
        try:
            summary = loop.train(run)
        finally:
            loop.build_engine = build_engine
        engine = seen["engine"]
        result = {"summary": summary, "model_backward_passes": seen["model_backward_passes"],
                  "layer_forwards": seen["layer_forwards"]}
        if engine.backend == "deepspeed":
            result["ds_global_steps"] = engine.model.global_steps
            result["ds_micro_steps"] = engine.model.micro_steps
        weights = _final_weights(engine)
        if dist.get_rank() == 0:
            result["weights"] = weights
        out.append(result)
    return out
