"""Communication of HDET across real ranks: interval losses and converge.

Everything here runs on an explicit group: the interval-loss vector on the world group,
converge and gradient sharing on the replica group. Nothing else in the package issues a
collective.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from hdet_scale import iterates
from hdet_scale import warm_init as wi
from hdet_scale.averaging import BucketBuffer, mean_all_reduce_
from hdet_scale.controller import fitness_noise
from hdet_scale.errors import HDETConfigError, HDETStepMismatchError
from hdet_scale.probe import probe_examples, probe_value
from hdet_scale.topology import Topology


class Sync(Protocol):
    """Communication needed by the scheduler (``HDETScheduler``): :class:`DistributedSync`
    for real ranks, ``simulate.SimulatedSync`` for R replicas in one process."""

    replicas: int
    local_replicas: list[int]  # replica indices whose param groups this process sets

    def add_loss(self, loss: Any) -> None: ...
    # Collective; resets. ``step``: this process's HDET step; a multi-rank sync checks
    # that every rank is at the same one (raises HDETStepMismatchError on every rank).
    def interval_losses(self, step: int) -> tuple[list[float], list[int]]: ...
    def probe_losses(self, probe: Any) -> list[float]: ...  # collective; fitness per replica
    def converge(self, finite: list[bool]) -> None: ...  # collective
    # Optional: ``synchronize()`` waits for the device work converge queued (timing);
    # without it the scheduler synchronizes ``sync.backend.device`` when not the CPU.
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Backend(Protocol):
    """What HDET needs from a training engine (one file per engine in ``backends/``)."""

    device: torch.device
    shares_gradients: bool  # True: the engine averages gradients over all W ranks itself

    def master_tensors(self) -> Sequence[torch.Tensor]: ...  # local tensors the optimizer updates
    def buffers(self) -> Sequence[torch.Tensor]: ...  # floating buffers to average
    def refresh(self) -> None: ...  # after converge: working copies <- masters
    def install_grad_hook(self, hook) -> None: ...  # hook(list[Tensor]) before each optimizer step
    # Backends whose engine already averages gradients over all W ranks in "global" mode
    # (DDP over the world, FSDP2 HSDP) set ``shares_gradients = True``: install_grad_hook
    # is then never called and may be absent.
    # install_overlapped_sharing(replica_group, replicas) -> object | None, optional: share
    # gradients overlapped with the backward pass instead of install_grad_hook (None: cannot).
    # noise_parts() -> (sharded, full): the masters that are this rank's shard of its
    # replica, and those it holds whole like every rank of the replica (warm init).
    # local_optimizer() -> context manager yielding the torch optimizer whose state is
    # keyed by master_tensors() (optional: engines that wrap the user's optimizer, ZeRO-3
    # and fairscale OSS; others pass the optimizer to DistributedSync).


def check_steps(steps: Sequence[int]) -> None:
    """Raise :class:`HDETStepMismatchError` unless every rank is at the same HDET step.

    Args:
        steps: ``steps[g]`` = global rank g's ``scheduler.step_count`` at this sync.
    """
    if len(set(steps)) <= 1:
        return
    at: dict[int, list[int]] = {}
    for g, s in enumerate(steps):
        at.setdefault(s, []).append(g)
    where = "; ".join(f"step {s}: rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                      for s, r in sorted(at.items()))
    raise HDETStepMismatchError(
        f"ranks reached an HDET sync at different steps ({where}). Every rank must call scheduler.step "
        "once per optimizer step, skipped or not. Likely causes: a rank resumed from another checkpoint "
        "than the others; an engine skipped an optimizer step (non-finite gradient) without counting it "
        "on some ranks; the training loop calls scheduler.step (or scheduler.sync) unevenly across ranks. "
        "Every rank raises this error at this sync.")


class LossAccumulator:
    """This rank's training-loss sum (float64) and count since the last sync, kept on the
    loss' device (no host sync per step); exact in ``state_dict``."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | float = 0.0
        self._count = 0

    def add_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(()).to(torch.float64)
        self._sum = self._sum + loss
        self._count += 1

    def take(self) -> tuple[float, int]:
        """``(sum, count)`` since the last call; resets."""
        s, c = float(self._sum), self._count
        self._sum, self._count = 0.0, 0
        return s, c

    def state_dict(self) -> dict:
        return {"loss_sum": float(self._sum), "loss_count": self._count}

    def load_state_dict(self, state: dict) -> None:
        self._sum = float(state["loss_sum"])
        self._count = int(state["loss_count"])


class DistributedSync(LossAccumulator):
    """Interval-loss reduction and converge for one rank of an ``R x S`` world.

    Args:
        topology: the process groups.
        backend: the engine adapter.
        bucket_bytes: converge / gradient bucket size in bytes.
        gradient_sharing: ``"global"`` installs the gradient hook that averages the local
            gradient partitions over the replica group before every optimizer step (so
            every replica applies the mean gradient of all W ranks, paper Sec. 3.1);
            ``"replica"`` installs nothing. A backend with ``shares_gradients = True``
            does the global average itself (its engine's own all-reduce).
        overlap_gradients: let a backend that can (``install_overlapped_sharing``:
            DeepSpeed, ``backends/ds_overlap.py``) overlap the gradient sharing with the
            backward pass instead of the hook; it returns ``None`` where it cannot, and
            the hook is installed.

    Memory: one reusable bucket (``self.bucket``, at most ``bucket_bytes`` per dtype and
    device, allocated on first use and kept) serves converge and every gradient-sharing
    call; nothing else is allocated per call (:mod:`hdet_scale.averaging`).
    """

    def __init__(self, topology: Topology, backend: Backend, bucket_bytes: int, gradient_sharing: str,
                 overlap_gradients: bool = False,
                 local_optimizer: Callable[[], ContextManager[Any]] | None = None) -> None:
        self.topology = topology
        self.local_optimizer = local_optimizer or (lambda: contextlib.nullcontext(None))
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.bucket = BucketBuffer()
        self.replicas = topology.replicas
        self.local_replicas = [topology.replica_index]
        self.probe_noise: float | None = None  # of the last probe_losses
        super().__init__()
        self.overlapped = None  # the backend's overlapped sharing, when it installed one
        if gradient_sharing == "global" and topology.replicas > 1 and not backend.shares_gradients:
            overlap = getattr(backend, "install_overlapped_sharing", None)
            if overlap_gradients and overlap is not None:
                self.overlapped = overlap(topology.replica_group, topology.replicas)
            if self.overlapped is None:
                backend.install_grad_hook(self.share_gradients)

    def share_gradients(self, grads: Sequence[torch.Tensor]) -> None:
        mean_all_reduce_(grads, self.topology.replica_group, self.bucket_bytes, buffer=self.bucket)

    def interval_losses(self, step: int) -> tuple[list[float], list[int]]:
        """Mean loss of every replica over the interval (mean over its S ranks and
        steps); NaN for a replica that recorded none. Collective on the world group: one
        all-reduce (SUM) of ``2 R + W`` float64 values, ``R x 2`` (loss sum, count) then
        one slot per global rank holding that rank's HDET ``step`` (exact in float64 up
        to 2^53), so every rank checks every rank's step at no extra collective.
        Resets the accumulators.

        Raises:
            HDETStepMismatchError: the ranks' steps differ; raised on every rank (all see
                the same reduced tensor), after the collective, so none is left waiting.
        """
        R, W = self.replicas, self.topology.world_size
        t = torch.zeros(2 * R + W, dtype=torch.float64, device=self.backend.device)
        t[2 * self.topology.replica_index] = self._sum
        t[2 * self.topology.replica_index + 1] = self._count
        t[2 * R + self.topology.rank] = step
        self._sum, self._count = 0.0, 0
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.topology.world_group)
        t = t.cpu()
        check_steps([int(x) for x in t[2 * R:].tolist()])
        t = t[:2 * R].view(R, 2)
        counts = [int(c) for c in t[:, 1].tolist()]
        losses = [s / c if c > 0 else float("nan") for s, c in zip(t[:, 0].tolist(), counts)]
        return losses, counts

    def probe_losses(self, probe: Any) -> list[float]:
        """Fitness of every replica: the mean over its S ranks of ``probe()``, this rank's
        loss (0-dim tensor or float, nats) on its slice of the probe batches, run under
        ``torch.no_grad``. Every replica must evaluate the same batches (shard rank s of
        every replica takes slice s) so that the losses differ by the weights alone.
        A probe may instead return its per-example losses (a 1-D tensor, the same length
        on every rank): the fitness is then their mean over the replica's examples, and
        ``probe_noise`` the standard error of the replicas' gaps
        (``controller.fitness_noise``), else ``None``.

        Collective on the world group: one all-reduce of 2 values (every rank's number
        of per-example losses, checked equal), then one of R values or of R x S x n
        per-example losses; the forward passes inside ``probe`` may issue the engine's
        own collectives. An optimizer with an evaluation point (schedule-free) is probed
        there (:meth:`eval_mode`).

        Raises:
            HDETConfigError: ranks returned different numbers of per-example losses
                (every rank, after the size all-reduce, before the losses' one).
        """
        with torch.no_grad(), self.eval_mode():
            loss = probe()
        examples = probe_examples(loss)
        value = probe_value(loss)
        dev = self.backend.device
        n = 0 if examples is None else examples.numel()
        sizes = torch.tensor([n, -n], dtype=torch.float64, device=dev)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.topology.world_group)
        most, least = int(sizes[0]), -int(sizes[1])
        if most != least:
            raise HDETConfigError(f"probe: the ranks returned between {least} and {most} per-example losses (0: one "
                                  "mean); every rank must return the same number, or each one mean")
        R, S = self.replicas, self.topology.shard_size
        if n == 0:
            t = torch.zeros(R, dtype=torch.float64, device=dev)
            t[self.topology.replica_index] = value / S
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.topology.world_group)
            self.probe_noise = None
            return t.cpu().tolist()
        t = torch.zeros(R, S, n, dtype=torch.float64, device=dev)
        t[self.topology.replica_index, self.topology.shard_index] = examples.to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.topology.world_group)
        per_example = t.cpu().reshape(R, S * n)
        self.probe_noise = fitness_noise(per_example)
        return per_example.mean(dim=1).tolist()

    def add_noise(self, nu: float, seed: int) -> None:
        """Warm noisy initialisation (:mod:`hdet_scale.warm_init`): add
        ``N(0, (nu * RMS)^2)`` to this rank's masters, RMS over the whole model, then
        refresh the working copies. The backend's ``noise_parts()`` says which masters
        are this rank's shard of its replica (their sum of squares is all-reduced over the
        shard group, and each shard draws its own noise: the draws depend on S, not their
        distribution) and which it holds whole, like every rank of its replica (drawn from
        one stream that no shard uses, the same on all of them). With S = 1 everything is
        whole and drawn from the simulator's stream. Collective on the shard group."""
        sharded, full = (list(x) for x in self.backend.noise_parts())
        S, r = self.topology.shard_size, self.topology.replica_index
        if S == 1:
            sharded, full = [], sharded + full
        sumsq, count = wi.sum_of_squares(sharded)
        if S > 1:
            t = torch.tensor([sumsq, float(count)], dtype=torch.float64, device=self.backend.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.topology.shard_group)
            sumsq, count = t.tolist()
        full_sumsq, full_count = wi.sum_of_squares(full)
        sumsq, count = sumsq + full_sumsq, count + full_count
        std = nu * (sumsq / count) ** 0.5 if count else 0.0
        if sharded:
            gen = torch.Generator().manual_seed(wi.noise_seed(seed, r, self.topology.shard_index))
            wi.add_noise_(sharded, std, gen)
        if full:
            gen = torch.Generator().manual_seed(wi.noise_seed(seed, r, S if S > 1 else 0))
            wi.add_noise_(full, std, gen)
        self.backend.refresh()

    def converge(self, finite: list[bool]) -> None:
        """Average the local masters and buffers over the replica group, leaving out the
        replicas with a non-finite interval loss (all, if none is finite), then refresh
        the working copies so the next forward pass sees the averaged weights. An
        optimizer's other iterates (schedule-free's ``z``) and group scalars are averaged
        in the same collectives (:mod:`hdet_scale.iterates`)."""
        n = sum(finite)
        keep = finite[self.topology.replica_index] if n else True
        n = n or self.replicas
        tensors = list(self.backend.master_tensors()) + list(self.backend.buffers())
        with self.local_optimizer() as opt:
            tensors += iterates.state_tensors(opt) if opt is not None else []
            values = iterates.group_scalars(opt) if opt is not None else []
            scalars = torch.tensor(values, dtype=torch.float64, device=self.backend.device)
            mean_all_reduce_(tensors + ([scalars] if values else []), self.topology.replica_group, self.bucket_bytes,
                             contribute=keep, contributors=n, buffer=self.bucket)
            if values:
                iterates.set_group_scalars(opt, scalars.cpu().tolist())
        self.backend.refresh()

    def has_eval_point(self) -> bool:
        """This rank's optimizer has train / eval modes (:mod:`hdet_scale.iterates`)."""
        with self.local_optimizer() as opt:
            return opt is not None and iterates.has_modes(opt)

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Inside, this rank's parameters hold the optimizer's evaluation point (x of a
        schedule-free optimizer: :func:`hdet_scale.iterates.eval_mode`), with the
        engine's working copies refreshed; on exit the training point again. Nothing for
        an optimizer with one iterate. Not collective itself, but the refresh of a
        sharded engine is (ZeRO-3's persistent parameters, OSS's broadcast): every rank
        of the replica enters it together."""
        with self.local_optimizer() as opt:
            switch = opt is not None and iterates.has_modes(opt) and iterates.in_train_mode(opt)
            if switch:
                self.backend.refresh()  # FSDP2: the optimizer's DTensors back on the module first
                iterates.switch_(opt, to_eval=True)
        if not switch:
            yield
            return
        self.backend.refresh()
        try:
            yield
        finally:
            with self.local_optimizer() as opt:
                iterates.switch_(opt, to_eval=False)
            self.backend.refresh()
