"""DeepSpeed ZeRO-3 pieces of :class:`~hdet_scale.hf.HDETTrainer` that stand alone: the
model built partitioned over the shard group (:func:`zero_init`) and the check that a
model handed to the engine was partitioned over that group (:func:`check_partitions`).

Source: deepspeed 0.19 ``zero.Init`` (partitions by the outermost context),
transformers 5.24 ``from_config`` under ZeRO-3 (``initialize_weights_zero3``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hdet_scale.errors import HDETConfigError
from hdet_scale.hf_constructors import watch_constructors
from hdet_scale.topology import Topology


def zero_init(args: Any, **kwargs: Any) -> Any:
    """``deepspeed.zero.Init`` over the shard group of ``args``' layout: build the model
    inside it (``from_config`` too) and no rank holds more than its partitions, on the
    process groups :class:`HDETTrainer` then trains::

        args = TrainingArguments(..., deepspeed="ds_config.json")
        with hdet_scale.hf.zero_init(args):
            model = AutoModelForCausalLM.from_config(config)
        trainer = HDETTrainer(model=model, args=args, ...)

    ``from_config``'s own ``zero.Init`` nests inside it and does nothing (DeepSpeed
    partitions by the outermost context). transformers then initialises the weights on
    global rank 0 only, so only replica 0's shard group gets them; :class:`HDETTrainer`
    copies replica 0's partitions to every replica when training starts, as HDET needs
    anyway (replicas start as copies of one model). A model built by its class
    constructor instead (``LlamaForCausalLM(config)``) gets no transformers init under
    ZeRO-3: a ``UserWarning`` at the context's exit says so (``hf_constructors``). Import the model's class before the
    context opens when the process builds another model of it afterwards (an evaluation
    copy): a class first defined inside loses transformers >= 5.25's kernels decorator
    when DeepSpeed closes it (:func:`hdet_scale.backends.deepspeed.zero_init`). ``kwargs``
    go to ``deepspeed.zero.Init``. Collective (the layout, on first use).

    Raises:
        HDETConfigError: as :func:`build_topology`, a DeepSpeed value that disagrees with
            ``TrainingArguments`` (:func:`hdet_scale.hf_config.check_trainer_values`), or
            an invalid config.
    """
    import deepspeed

    from hdet_scale.backends.deepspeed import zero_init as _zero_init
    from hdet_scale.hf import build_topology
    from hdet_scale.hf_config import _checkable, check_trainer_values

    check_trainer_values(args.hf_deepspeed_config)
    topology = build_topology(args)
    # Accelerate initialised torch.distributed, not DeepSpeed's comm layer, which zero.Init
    # reads (without it, its config sees a world of 1 and refuses the batch size).
    deepspeed.init_distributed(dist_backend="gloo" if args.device.type == "cpu" else None)
    max_steps = args.max_steps if args.max_steps > 0 else None
    context = _zero_init(topology, _checkable(args.hf_deepspeed_config.config, max_steps), **kwargs)
    return _both(context)


@contextlib.contextmanager
def _both(context: Any) -> Iterator[Any]:
    # the watch outside zero.Init: its warning comes after DeepSpeed's exit
    with watch_constructors(), context as inner:
        yield inner


def check_partitions(model: Any, topology: Topology) -> None:
    """Refuse a model ZeRO-3 already partitioned over another group than the shard group
    (``Trainer``'s ``from_config`` under ``deepspeed.zero.Init`` partitions over the world):
    DeepSpeed would read each partition with the wrong size. Same verdict on every rank
    (the group sizes are global)."""
    import torch.distributed as dist

    for p in () if model is None else model.parameters():
        group = getattr(p, "ds_process_group", None)
        if group is not None and dist.get_world_size(group) != topology.shard_size:
            raise HDETConfigError(
                f"model: partitioned by deepspeed.zero.Init over {dist.get_world_size(group)} ranks, but each hdet "
                f"replica shards over {topology.shard_size}; build it under hdet_scale.hf.zero_init(args), or "
                "whole (LlamaForCausalLM(config)): DeepSpeed then partitions it when training starts")
        return
