"""Gradient sharing on DeepSpeed ZeRO-3, overlapped with the backward pass.

HDET's "global" gradient sharing averages each rank's ZeRO-3 gradient partition over
its replica group before every optimizer step (``sync.DistributedSync``). Done as a
hook before the step, that all-reduce waits for the whole backward pass and then holds
the step up: 21 ms, 10 % of a step on the CPU benchmark here, and by the cost model
~25 % of a 2 s step for a 7B model on 8 x 8 ranks at 100 Gbit/s (docs/benchmarks.md).

ZeRO-3 reduce-scatters the gradients bucket by bucket during the backward pass
(``DeepSpeedZeroOptimizer_Stage3.partition_grads`` writes each bucket's partitions into
the flat fp32 gradient buffer). At the accumulation boundary a partition written there
is final, so this module starts an asynchronous all-reduce (SUM) of it over the replica
group at once, while the backward pass goes on with the next buckets; before the step it
waits for them, all-reduces what no bucket wrote (partitions of parameters that got no
gradient this step), and divides the whole buffer by the replica count. The result is
the mean the hook computes: bit for bit with 2 replicas (a sum of two floats does not
depend on the order), to float rounding with more (the order in which gloo or NCCL add
R > 2 values depends on how a message is chunked).

Used when the flat gradient buffer is float32 (DeepSpeed's gradient accumulation dtype:
float32 in fp32 training, and in bf16 training with ``"data_types": {"grad_accum_dtype":
"fp32"}``) and the optimizer is not offloaded. Otherwise the hook
(``DeepSpeedBackend.install_grad_hook``) runs: a bf16 buffer is summed in fp32 through a
reusable bucket, one rounding, which an in-place bf16 all-reduce would not give.
Extra memory: none (in place, no bucket). Collectives: one per run of adjacent
partitions written by one bucket, in the same order on every rank of a replica group
(the ranks with one shard index run the same bucket schedule over the same layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class OverlappedGradientSharing:
    """Installed on a ZeRO-3 optimizer by :meth:`install`; see the module docstring.

    Args:
        optimizer: ``DeepSpeedZeroOptimizer_Stage3`` (the engine's ``optimizer``).
        group: the replica group (the ranks holding the same shard in every replica).
        replicas: the size of ``group``: the divisor of the mean.
    """

    def __init__(self, optimizer: Any, group: dist.ProcessGroup, replicas: int) -> None:
        self.optimizer, self.group, self.replicas = optimizer, group, replicas
        self.pending: list[tuple[Any, int, int]] = []  # (work, start, end) in elements of self.flat
        self.collectives = 0  # issued since install: the benchmark counts them

    @property
    def flat(self) -> torch.Tensor:
        # read each time: DeepSpeed's offload_states / reload_states replace its storage
        return self.optimizer.grad_partitions_flat_buffer

    @staticmethod
    def supported(optimizer: Any) -> str | None:
        """Why this optimizer cannot be overlapped (``None`` when it can)."""
        flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
        if flat is None or not callable(getattr(optimizer, "partition_grads", None)):
            return "not a DeepSpeed ZeRO-3 optimizer with a flat gradient buffer"
        if flat.dtype != torch.float32:
            return f"its flat gradient buffer is {flat.dtype}, not float32"
        if getattr(optimizer, "offload_optimizer", False):
            return "the optimizer is offloaded"
        return None

    def install(self) -> None:
        """Wrap the optimizer's ``partition_grads`` (start the all-reduces) and ``step``
        (finish them first, so the overflow check and clipping see the shared gradient)."""
        opt = self.optimizer
        partition_grads, step = opt.partition_grads, opt.step

        def partition_grads_and_share(params: list, grad_partitions: list) -> Any:
            buffers = partition_grads(params, grad_partitions)
            if opt.is_gradient_accumulation_boundary():
                self._start(buffers)
            return buffers

        def step_after_sharing(*args: Any, **kwargs: Any) -> Any:
            self.finish()
            return step(*args, **kwargs)

        opt.partition_grads, opt.step = partition_grads_and_share, step_after_sharing

    def _span(self, view: torch.Tensor) -> tuple[int, int]:
        start = (view.data_ptr() - self.flat.data_ptr()) // self.flat.element_size()
        return start, start + view.numel()

    def _start(self, buffers: list[torch.Tensor]) -> None:
        """One asynchronous all-reduce per run of adjacent partitions of this bucket."""
        spans = sorted(self._span(b) for b in buffers if b.numel() > 0)
        runs: list[list[int]] = []
        for start, end in spans:
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        for start, end in runs:
            work = dist.all_reduce(self.flat[start:end], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self.pending.append((work, start, end))
            self.collectives += 1

    def finish(self) -> None:
        """Wait for the started all-reduces, all-reduce the gaps no bucket wrote (in one
        message each), then divide the whole buffer by the replica count."""
        covered = sorted((s, e) for _, s, e in self.pending)
        for work, _, _ in self.pending:
            work.wait()
        self.pending = []
        at = 0
        for start, end in covered + [(self.flat.numel(), self.flat.numel())]:
            if start > at:  # partitions that got no gradient this step: zeros, or an earlier value
                dist.all_reduce(self.flat[at:start], op=dist.ReduceOp.SUM, group=self.group)
                self.collectives += 1
            at = max(at, end)
        self.flat.div_(self.replicas)
