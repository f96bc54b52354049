"""Byte-level language-modelling data for the reference trainer.

The vocabulary is the 256 byte values, so no tokenizer (and no download) is needed.
By default the corpus is the ``.py`` source of the Python standard library installed
on the machine, which every rank of a job can read locally. Which files ``data.path``
names, and which it refuses (not text, not a regular file): ``data_files.py``.

Determinism contract
--------------------
* :func:`load_corpus` reads files in sorted order and splits them into train and
  validation by a stable hash of their relative path and ``seed``; the result depends
  only on the file contents, the arguments, and (for the default corpus) the Python
  version, never on the rank, the world size or the process RNG state.
* :class:`ByteBatches` draws window starts from a private :class:`torch.Generator`
  seeded from ``(seed, step)``. It never touches the global RNG. A step draws the
  whole *global* batch (``micro_batch_size * world_size`` windows) and each rank takes
  its own slice, so the global batch of a step is the same for any rank layout.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.data_files import Files, collect, default_corpus_files, stdlib_root
from hdet_scale.train.data_read import SEPARATOR, read_splits

__all__ = [
    "Corpus",
    "ByteBatches",
    "default_corpus_files",
    "fingerprint",
    "load_corpus",
    "unigram_entropy",
]

# --------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """A byte corpus split into train and validation.

    Attributes:
        train: 1-D ``torch.uint8`` tensor of training bytes (on CPU).
        val: 1-D ``torch.uint8`` tensor of validation bytes (on CPU).
        train_files: number of files (or file parts) that contributed to ``train``.
        val_files: number of files (or file parts) that contributed to ``val``.
        source: human-readable description of where the bytes came from.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    source: str


def fingerprint(corpus: Corpus) -> dict[str, int]:
    """What a resume compares to tell whether the bytes trained on changed since a
    checkpoint (``resume_config``: a file added to ``data.path``, lines appended inside
    ``data.max_bytes``): ``{"train_bytes", "val_bytes", "crc32"}``, the splits' sizes and
    the CRC-32 of the training then the validation bytes. Reads the tensors only (about
    1 GB/s); the same on every rank that loaded the same corpus."""
    crc = zlib.crc32(memoryview(corpus.train.numpy()))
    crc = zlib.crc32(memoryview(corpus.val.numpy()), crc)
    return {"train_bytes": int(corpus.train.numel()), "val_bytes": int(corpus.val.numel()), "crc32": int(crc)}


def _to_tensor(chunks: list[bytes]) -> torch.Tensor:
    buf = bytearray(SEPARATOR.join(chunks))
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def load_corpus(path: str | None, val_fraction: float, max_bytes: int, seed: int,
                run_dir: str | None = None) -> Corpus:
    """Load a byte corpus and split it into train and validation.

    Args:
        path: ``None`` for the default corpus (:func:`default_corpus_files`);
            otherwise a UTF-8 text file, a folder (all regular files recursively,
            linked files and folders followed, each file once, sorted by relative path,
            skipping hidden files/dirs and files whose first 64 KiB are not UTF-8 text),
            or several such paths separated by ``,`` (``data_files.collect``). A folder's
            file is opened only when the reading comes to it (``data_read.read_splits``).
        val_fraction: fraction in (0, 1) of files (and of the byte budget) that go to
            validation.
        max_bytes: total byte budget, > 0. Train gets
            ``int(max_bytes * (1 - val_fraction))`` bytes at most, validation the rest.
            Files are read in order only until their split's budget is full (the last
            one is truncated), so loading a large corpus stays fast.
        seed: seed of the file split; the same seed gives the same split everywhere.
        run_dir: the run's folder: a file of ``path`` whose real path is inside it is
            refused (a link in a data folder into the run's own files).

    With two or more files the split is by file: a file goes to validation when
    ``crc32(f"{seed}\\x1f{relative_path}") / 2**32 < val_fraction``; if a split would be
    empty, the file with the smallest (for val) or largest (for train) hash is moved.
    With a single file, its first ``max_bytes`` bytes are split by position: the last
    ``val_fraction`` part is validation. Files of one split are concatenated in sorted
    order with a ``b"\\n"`` separator.

    Returns:
        A :class:`Corpus` with 1-D ``torch.uint8`` CPU tensors.

    Raises:
        HDETConfigError: ``data.val_fraction`` not in (0, 1); ``data.max_bytes`` not
            positive; ``data.path`` missing, unreadable, not a regular file or folder
            (``/dev/null``, a FIFO), a file that is not UTF-8 text, yielding no files, or
            yielding an empty train or validation split.
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not (
        0.0 < float(val_fraction) < 1.0
    ):
        raise HDETConfigError(
            f"data.val_fraction must be a number in (0, 1) (exclusive); got {val_fraction!r}"
        )
    val_fraction = float(val_fraction)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2:
        raise HDETConfigError(f"data.max_bytes must be an integer >= 2; got {max_bytes!r}")

    if path is None:
        root = stdlib_root()
        listed = default_corpus_files()
        files = Files([(f.relative_to(root).as_posix(), str(f)) for f in listed], judge=False)
        source = f"python-stdlib:{root}"
        if not len(files):
            raise HDETConfigError(
                f"data.path is unset and the default corpus (standard library at {root}) "
                "has no .py files; set data.path to a text file or folder"
            )
    else:
        files, source = collect(str(path), run_dir)

    train_chunks, val_chunks = read_splits(files, val_fraction, max_bytes, seed, source)
    return Corpus(
        train=_to_tensor(train_chunks),
        val=_to_tensor(val_chunks),
        train_files=len(train_chunks),
        val_files=len(val_chunks),
        source=source,
    )


# --------------------------------------------------------------------------- statistics


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy, in nats, of the byte histogram (256 bins) of ``data``.

    This is the loss of the best context-free byte predictor, a useful reference for
    the trainer's loss curve (``ln 256 ~= 5.545`` is the loss of a uniform predictor).

    Args:
        data: ``torch.uint8`` tensor of any shape (flattened), non-empty.

    Returns:
        ``-sum_b p_b ln p_b`` over byte values with ``p_b > 0``, as a Python float.

    Raises:
        ValueError: ``data`` is empty or not ``torch.uint8``.
    """
    if data.dtype != torch.uint8:
        raise ValueError(f"unigram_entropy expects a torch.uint8 tensor; got {data.dtype}")
    if data.numel() == 0:
        raise ValueError("unigram_entropy of an empty tensor is undefined")
    counts = torch.bincount(data.reshape(-1).to(torch.int64), minlength=256).to(torch.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


# --------------------------------------------------------------------------- batches


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of ``(seed, step)`` -> non-negative 63-bit generator seed."""
    mask = (1 << 64) - 1
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 0x632BE59BD9B4E019) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return x & ((1 << 63) - 1)


class ByteBatches:
    """Random fixed-length windows over a byte tensor, sharded deterministically.

    A *window* is ``seq_len + 1`` consecutive bytes starting at ``s`` with
    ``0 <= s <= len(data) - seq_len - 1``; there are ``len(data) - seq_len`` windows.

    Args:
        data: 1-D ``torch.uint8`` tensor (CPU), e.g. ``Corpus.train``.
        seq_len: tokens (bytes) per sequence, > 0 (config key ``data.seq_len``).
        micro_batch_size: sequences per rank per step, > 0 (``deepspeed.train_micro_batch_size_per_gpu``).
        seed: data seed; with ``step`` it fully determines the windows.
        rank: this process's data-parallel rank, ``0 <= rank < world_size``.
        world_size: number of data-parallel ranks, > 0.
        key: name of the data set used in error messages (e.g. ``"data.train"``).

    Raises:
        HDETConfigError: invalid arguments, or the data set is too small for one global
            batch: ``len(data)`` must be at least
            ``seq_len + micro_batch_size * world_size`` bytes (``seq_len + 1`` bytes per
            window and ``micro_batch_size * world_size`` distinct windows). The message
            names ``data.seq_len`` and ``deepspeed.train_micro_batch_size_per_gpu`` and gives both the
            needed and the available byte counts.
    """

    def __init__(
        self,
        data: torch.Tensor,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        key: str = "data",
    ) -> None:
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
            raise HDETConfigError(f"{key}: expected a 1-D torch.uint8 tensor of bytes")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise HDETConfigError(f"data.seq_len must be an integer >= 1; got {seq_len!r}")
        if (
            isinstance(micro_batch_size, bool)
            or not isinstance(micro_batch_size, int)
            or micro_batch_size < 1
        ):
            raise HDETConfigError(
                f"deepspeed.train_micro_batch_size_per_gpu must be an integer >= 1; got {micro_batch_size!r}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise HDETConfigError(
                f"{key}: rank={rank} / world_size={world_size} is not a valid layout"
            )
        self.data = data.cpu()
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.key = key

        n = self.data.numel()
        global_batch = micro_batch_size * world_size
        needed = seq_len + global_batch
        if (n < seq_len + 1 or n - seq_len < global_batch) and global_batch == 1:
            # a split read one window at a time (validation): the batch keys play no part
            raise HDETConfigError(
                f"{key}: data set too small: it has {n} bytes but one window of data.seq_len={seq_len} needs "
                f"{seq_len + 1} bytes (the inputs and the next byte). Use more data (data.path / "
                "data.max_bytes, data.val_fraction) or lower data.seq_len")
        if n < seq_len + 1 or n - seq_len < global_batch:
            raise HDETConfigError(
                f"{key}: data set too small for one batch: it has {n} bytes but needs at "
                f"least {needed} bytes (data.seq_len={seq_len} -> {seq_len + 1} bytes per "
                f"window, and deepspeed.train_micro_batch_size_per_gpu={micro_batch_size} x "
                f"world_size={world_size} = {global_batch} distinct windows). Use more "
                "data (data.path / data.max_bytes) or lower data.seq_len or "
                "deepspeed.train_micro_batch_size_per_gpu"
            )
        self.num_windows = n - seq_len
        self._offsets = torch.arange(seq_len + 1, dtype=torch.int64)

    def _gather(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[starts.to(torch.int64)[:, None] + self._offsets].to(torch.int64)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def global_starts(self, step: int) -> torch.Tensor:
        """Window starts of the whole global batch of ``step``.

        Returns:
            int64 tensor of shape ``(micro_batch_size * world_size,)``; rank ``r`` uses
            ``[r * micro_batch_size : (r + 1) * micro_batch_size]``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0; got {step}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_mix_seed(self.seed, step))
        return torch.randint(
            0,
            self.num_windows,
            (self.micro_batch_size * self.world_size,),
            generator=gen,
            dtype=torch.int64,
        )

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch of ``step``.

        Windows are drawn with replacement from a private generator seeded from
        ``(seed, step)``; the global RNG is neither read nor changed.

        Returns:
            ``(inputs, targets)``: CPU ``torch.int64`` tensors of shape
            ``(micro_batch_size, seq_len)`` with byte values in [0, 255];
            ``targets[:, t] == inputs[:, t + 1]`` for ``t < seq_len - 1`` (targets are
            the inputs shifted left by one byte). Move them to the device yourself.
        """
        starts = self.global_starts(step)
        mb = self.micro_batch_size
        return self._gather(starts[self.rank * mb : (self.rank + 1) * mb])

    def eval_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic validation batches over evenly spaced windows.

        ``num_batches * micro_batch_size`` window starts are spread evenly from the
        first to the last window (``round(i * (num_windows - 1) / (n - 1))``), so the
        batches cover the whole data set. The list is **identical on every rank** (it
        ignores ``rank``): either every rank evaluates all of it (each gets the same
        mean loss, no collective needed), or the caller shards it, e.g.
        ``batches[rank::world_size]``, and all-reduces the losses.

        Args:
            num_batches: number of batches, >= 1.

        Returns:
            List of ``num_batches`` ``(inputs, targets)`` pairs, CPU ``torch.int64``,
            each of shape ``(micro_batch_size, seq_len)``, targets shifted by one byte.
        """
        if num_batches < 1:
            raise HDETConfigError(
                f"{self.key}: number of eval batches must be >= 1; got {num_batches}"
            )
        n = num_batches * self.micro_batch_size
        if n == 1:
            starts = torch.zeros(1, dtype=torch.int64)
        else:
            idx = torch.arange(n, dtype=torch.float64)
            starts = torch.round(idx * (self.num_windows - 1) / (n - 1)).to(torch.int64)
        inputs, targets = self._gather(starts)
        mb = self.micro_batch_size
        return [
            (inputs[i * mb : (i + 1) * mb], targets[i * mb : (i + 1) * mb])
            for i in range(num_batches)
        ]
