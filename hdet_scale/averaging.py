"""Bucketed mean all-reduce of local tensors over the replica group.

Converge (paper Eq. 3: ``theta_r <- mean_r' theta_r'``) and global gradient sharing both
average a rank's *local* tensors (ZeRO-3 / FSDP shards, fp32 masters, flat gradient
partitions) with the ranks holding the same shard index in the other replicas. One
collective per bucket, not per tensor.

How a tensor travels (:func:`mean_all_reduce_`), and what it costs:

- A contiguous tensor already in its accumulation dtype (float32, float64) of at least
  ``bucket_bytes`` is reduced in place: all-reduce, then divide. No extra memory, one
  memory pass besides the collective.
- Every other tensor (smaller ones, low-precision ones of any size, non-contiguous ones)
  is streamed through one flat bucket of at most ``bucket_bytes`` in the accumulation
  dtype (float32 for fp16 / bf16), slice by slice: copy in (casting up; one ``cat`` for a
  bucket of same-dtype slices), all-reduce SUM, divide while copying back (casting down).
  Two memory passes (three for fp16 / bf16 on CPU, where a casting division would make a
  hidden temporary: the bucket is divided in place, then copied out). A tensor larger
  than the room left in the bucket is split across buckets, so a bf16 gradient partition
  of any size costs one bucket of memory, never a full-size float32 copy.
- The bucket is one reusable buffer (:class:`BucketBuffer`); a caller that passes the
  same one to every call (``DistributedSync`` does) allocates it once.

Collectives issued, per (accumulation dtype, device) group of tensors: one per in-place
tensor, plus ``ceil(streamed bytes / bucket_bytes)`` (streamed bytes counted in the
accumulation dtype; a non-contiguous tensor is cut along its dims, which may leave a
bucket partly filled). Extra memory: at most one bucket per group, ``BucketBuffer.nbytes``.

Arithmetic: each element's mean is ``(sum over ranks, in the accumulation dtype) / n``,
rounded once more to the tensor's dtype for fp16 / bf16. Packing, splitting and the
in-place path do not change it (all element-wise), and every rank divides the same
all-reduce result by the same ``n``: the result is identical on every rank of the group.
``hdet_scale.simulate`` mirrors this arithmetic.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

_LOW = (torch.float16, torch.bfloat16)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is summed in: float32 for fp16 / bf16 (one rounding
    back at the end), its own dtype otherwise."""
    return torch.float32 if dtype in _LOW else dtype


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    # Groups of whole tensors of one dtype of at most bucket_bytes (a larger tensor alone);
    # used by backends.common.broadcast_module at start-up, not by mean_all_reduce_.
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for group in by_key.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if nbytes >= bucket_bytes:
                yield [t]
                continue
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def persistent_float_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers converge averages: floating and persistent (in ``state_dict``), such
    as BatchNorm running statistics, in ``named_buffers()`` order. Non-persistent ones
    (rotary tables) are derived constants, equal on every replica; averaging them could
    change their bits."""
    out, seen = [], set()
    for m in module.modules():
        # torch's own rule (Module._save_to_state_dict). Calling state_dict() instead
        # would also build an entry per parameter (a DTensor each under FSDP2: ~4 ms for
        # 300 tensors here, at every converge).
        skip = m._non_persistent_buffers_set
        for name, b in m._buffers.items():
            if b is not None and name not in skip and b.is_floating_point() and id(b) not in seen:
                seen.add(id(b))
                out.append(b)
    return out


class BucketBuffer:
    """Reusable flat bucket storage for :func:`mean_all_reduce_`: one 1-D tensor per
    (dtype, device), grown on demand up to the largest bucket asked for, kept between
    calls. Not thread-safe; one caller at a time (a collective is in flight on it)."""

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (uninitialised), a view of the kept buffer."""
        key = (dtype, torch.device(device))
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel:
            self._flat.pop(key, None)  # free the smaller one before allocating its successor
            flat = torch.empty(numel, dtype=dtype, device=device)
            self._flat[key] = flat
        return flat[:numel]

    @property
    def nbytes(self) -> int:
        """Bytes held between calls."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())


class _Stream:
    """Streams tensors through one bucket: copy in, all-reduce SUM, divide on the way
    back. ``calls`` counts the collectives issued."""

    def __init__(self, bucket: torch.Tensor, group: dist.ProcessGroup, n: int, contribute: bool) -> None:
        self.bucket, self.group, self.n, self.contribute = bucket, group, n, contribute
        self.fill = 0
        self.pending: list[torch.Tensor] = []  # views of the caller's tensors, in bucket order
        self.calls = 0

    def add(self, t: torch.Tensor) -> None:
        cap = self.bucket.numel()
        if t.is_contiguous():
            flat = t.view(-1)
            start = 0
            while start < flat.numel():  # fill every bucket to the brim: ceil(bytes / bucket) collectives
                if self.fill == cap:
                    self.flush()
                take = min(cap - self.fill, flat.numel() - start)
                self._put(flat[start:start + take])
                start += take
        elif t.numel() <= cap:
            if t.numel() > cap - self.fill:
                self.flush()
            self._put(t)
        else:
            # A non-contiguous tensor larger than a bucket: cut it into views along dim 0
            # (blocks of rows that fit, or single rows cut further), never copy it whole.
            row = t[0].numel()
            rows = cap // row if row else t.shape[0]
            for part in (t.split(rows) if rows else t.unbind(0)):
                self.add(part)

    def _put(self, piece: torch.Tensor) -> None:
        self.pending.append(piece)  # copied in at flush, all pieces of the bucket at once
        self.fill += piece.numel()

    def flush(self) -> None:
        if self.fill == 0:
            return
        flat = self.bucket[:self.fill]
        pieces = self.pending
        views = [v if p.dim() == 1 else v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in pieces]), pieces)]
        same = all(p.dtype == flat.dtype for p in pieces)
        if not self.contribute:
            flat.zero_()
        elif same and all(p.dim() == 1 for p in pieces):
            torch.cat(pieces, out=flat)  # one op for the whole bucket (no temporary: same dtype)
        else:
            for v, p in zip(views, pieces):
                v.copy_(p)  # casts fp16 / bf16 up on the way
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        self.calls += 1
        if same or flat.device.type != "cpu":
            # Divide straight into the caller's tensors: two memory passes in all (on
            # CUDA a cast to bf16 / fp16 happens inside the kernel, after the division).
            for v, p in zip(views, pieces):
                torch.div(v, self.n, out=p)
        else:
            # On CPU an out= of another dtype goes through a hidden temporary of the
            # piece's size in float32: divide the bucket in place, then cast each piece.
            flat.div_(self.n)
            for v, p in zip(views, pieces):
                p.copy_(v)
        self.fill = 0
        self.pending = []


@torch.no_grad()
def mean_all_reduce_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int,
                     contribute: bool = True, contributors: int | None = None,
                     buffer: BucketBuffer | None = None) -> int:
    """Replace every tensor by its mean over ``group``, in place (module docstring).

    Args:
        tensors: this rank's local tensors (any shapes, contiguous or not; floating
            dtypes). Every rank of ``group`` must pass tensors of the same shapes, dtypes
            and order.
        group: the process group (the replica group for HDET).
        bucket_bytes: size of one collective's message, in bytes of the accumulation
            dtype (float32 for fp16 / bf16 tensors); also the extra memory used.
        contribute: ``False`` leaves this rank's values out of the mean (a replica whose
            interval loss was non-finite); the rank still receives the mean.
        contributors: how many ranks of ``group`` contribute (default: its size).
        buffer: the bucket storage to use (kept between calls); default: a new one,
            freed on return.

    Low-precision tensors are summed in float32 and cast back, so a bf16 tensor is
    averaged with one rounding. The result is identical on every rank of the group
    (one all-reduce result, divided by the same integer).

    Returns:
        The number of collectives issued.
    """
    n = dist.get_world_size(group) if contributors is None else contributors
    buffer = BucketBuffer() if buffer is None else buffer
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() > 0:
            groups.setdefault((accumulate_dtype(t.dtype), t.device), []).append(t)
    calls = 0
    for (acc, device), group_tensors in groups.items():
        cap = max(1, bucket_bytes // acc.itemsize)
        streamed = []
        for t in group_tensors:
            if t.dtype == acc and t.is_contiguous() and t.numel() >= cap:
                # Large and already in the accumulation dtype: in place, no copy.
                if not contribute:
                    t.zero_()
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
                t.div_(n)
                calls += 1
            else:
                streamed.append(t)
        if streamed:
            need = sum(t.numel() for t in streamed)
            stream = _Stream(buffer.get(acc, device, min(cap, need)), group, n, contribute)
            for t in streamed:
                stream.add(t)
            stream.flush()
            calls += stream.calls
    return calls
