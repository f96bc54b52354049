"""An hdet-train checkpoint during the run: saved (its settings recorded first, the newest
``train.keep_checkpoints`` kept; a full disk named as such) and loaded (a file that still
fails after the checks named with the folder and the engine's reason). Where the run
starts from, and what a resume keeps: ``rundir.py``."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from typing import Any

from hdet_scale.backends.checkpoint_io import prune_checkpoints, read_latest
from hdet_scale.errors import HDETStateError
from hdet_scale.logging import DISK_FULL, size_limit_failure, write_failure
from hdet_scale.train import resume_config


def save(engine: Any, path: str, keep: int, run: dict | None = None, wandb_run_id: str | None = None,
         data: dict | None = None) -> None:
    """The backend's checkpoint of ``engine`` (``engines.py`` ``save``: atomic, ``latest``
    moves last), then keep the newest ``keep``. Collective. With ``run``, rank 0 first
    records its settings for the save's tag (``resume_config.save_record``: what a later
    resume compares itself with), ``wandb_run_id``, the W&B run a resume continues, and
    ``data``, the corpus' ``data.fingerprint``.

    Raises:
        HDETStateError: a full disk, a quota, a file size limit, a permission or a
            read-only file system stopped the record or the save (:func:`save_error`; inside FSDP2's ``CheckpointException`` too).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    sched = engine.scheduler
    try:
        if run is not None and sched.topology.rank == 0:
            # the tag every backend's save takes by default (checkpoints.checkpoint_target)
            resume_config.save_record(path, f"global_step{sched.step_count}", run, wandb_run_id, data)
        engine.save(path)
    except CheckpointException as e:
        # DCP (FSDP2) gathers every rank's failure and raises this on all of them alike: a
        # full disk inside it is named as one too
        for inner, _ in e.failures.values():
            named = save_error(path, sched.step_count, inner)
            if named is not inner:
                raise named from None
        raise
    except (OSError, RuntimeError) as e:
        raise save_error(path, sched.step_count, e) from None
    prune_checkpoints(path, sched.topology, keep)


LOW_SPACE_BYTES = 64 * 2**20  # below this after a failed save, the failure is called a full disk


def check_resume_writable(run_dir: str, ckpt: str) -> None:
    """Before a resume starts any rank: what the resumed run writes must be writable
    (a read-only ``checkpoint/`` would fail with a traceback at the first save, 51 s in,
    and a read-only ``metrics.jsonl`` be silently replaced by a writable copy).
    Checked: ``run_dir``, its ``metrics.jsonl``, ``summary.json`` and ``plots``, and the
    checkpoint folder with its entries (``latest``, the layout, the settings record, the
    ``replica_*`` folders). Read-only: no write permission bit at all (also for root,
    whom the kernel lets write anyway: the user marked it so) or ``os.access`` denies it.

    Raises:
        HDETStateError: naming every read-only path (the first three, and a count), and
            the fix.
    """
    def read_only(p: str) -> bool:
        try:
            return not os.stat(p).st_mode & 0o222 or not os.access(p, os.W_OK)
        except OSError:
            return False  # gone, or a dangling link: the save replaces it

    paths = [run_dir, *(os.path.join(run_dir, n) for n in ("metrics.jsonl", "summary.json", "plots")), ckpt]
    try:
        paths += sorted(e.path for e in os.scandir(ckpt))
    except OSError:
        pass
    bad = [p for p in paths if read_only(p)]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise HDETStateError(f"train.resume: {', '.join(bad[:3])}{more} {'is' if len(bad) == 1 else 'are'} read-only, "
                             "and the resumed run appends to metrics.jsonl, saves into the checkpoint folder and "
                             f"rewrites summary.json and the plots: make them writable (chmod -R u+w {run_dir}), or "
                             "copy the run to another run_dir and resume there")


def save_error(path: str, step: int, error: BaseException, low_bytes: int = LOW_SPACE_BYTES) -> BaseException:
    """What a failed save of step ``step`` into ``path`` raises: an :class:`HDETStateError`
    naming a full disk (``ENOSPC``, or less than ``low_bytes`` left on ``path``'s device:
    torch's writer says "unexpected pos" or "iostream error" without an errno), a disk
    quota (``EDQUOT``) or the file size limit (``EFBIG``; torch's errno-less error too while
    this process has a finite ``ulimit -f``), the free space and the checkpoint
    ``latest`` still names (not two tracebacks and no word of the disk); ``error``
    itself otherwise."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    errno_less = isinstance(error, RuntimeError) and getattr(error, "errno", None) is None  # torch's writer
    failure = (write_failure(error) or (size_limit_failure() if errno_less else None)
               or (DISK_FULL if free is not None and free < low_bytes else None))
    if failure is None:
        return error
    cause, fix = failure
    tag = read_latest(path)
    kept = (f"latest still names {tag}, complete; {fix}, then train.resume=true continues from it" if tag
            else f"no checkpoint is complete yet, so nothing can be resumed; {fix}, then start the run over "
            "with train.overwrite=true (the same run_dir holds this attempt's files), or choose another run_dir")
    left = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    reason = " ".join(str(error).split())[:200]  # an OSError's may name its file
    return HDETStateError(f"checkpoint: the save of step {step} into {path} failed, {cause} ({left}; "
                          f"{type(error).__name__}: {reason}); {kept}")


def load(engine: Any, path: str) -> None:
    """The backend's load of the checkpoint ``latest`` names in ``path``. Its files were
    checked before any rank started (``checkpoints.check_resumable``: structure) and by the
    load itself (``checkpoint_io.verify_checksums``: each archive's CRC-32s); a load that
    still fails on a file is reported with the folder and the engine's reason.

    Raises:
        HDETStateError: the engine could not read the checkpoint (the file or folder and
            the engine's own error); also for ``torch.distributed.checkpoint``'s
            ``CheckpointException`` (FSDP2), a ``BaseException`` that wraps each rank's
            error, when one of those is a damaged file's.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        engine.load(path)
    except HDETStateError:
        raise
    except CheckpointException as e:
        # DCP gathers every shard rank's exception and raises this on all of them alike.
        inner = [exc for exc, _ in e.failures.values() if _is_file_error(exc)]
        if not inner:
            raise
        raise _load_error(engine, path, inner[0]) from e
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as e:
        if not _is_file_error(e):
            raise
        raise _load_error(engine, path, e) from e


def _is_file_error(e: BaseException) -> bool:
    """Whether ``e`` is what reading a damaged checkpoint file raises. torch.load's
    damaged-archive error is a RuntimeError ("PytorchStreamReader ..."); other RuntimeErrors
    here are a peer's failure seen in a collective: not a file's fault."""
    if isinstance(e, RuntimeError):
        return "PytorchStreamReader" in str(e)
    return isinstance(e, (OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError))


def _load_error(engine: Any, path: str, e: BaseException) -> HDETStateError:
    """The message for a checkpoint that failed to load with ``e``. A damaged file was
    already named by the check every backend's load runs first
    (``checkpoint_io.verify_checksums``); what fails here is a file that passed it (another
    archive in its place, another run's state), so the message names the folders and the
    engine's reason."""
    tag = read_latest(path)
    return HDETStateError(f"train.resume: could not load the checkpoint {path}/replica_*/{tag}: {type(e).__name__}: "
                          f"{_engine_reason(e)[:500]}")


def _engine_reason(e: BaseException) -> str:
    """The engine's error on one line, without torch.load's advice to retry with
    ``weights_only=False``: for a damaged file that advice is wrong, and unpickling an
    untrusted file with it can run arbitrary code."""
    text = " ".join(str(e).split())
    if "Weights only load failed" in text:
        match = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation| Please file|$)", text)
        return "the file could not be unpickled" + (f" ({match.group(1).strip()})" if match else "")
    return text
