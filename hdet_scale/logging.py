"""Metric sinks: a JSONL file (the record tests read), Weights & Biases, nothing else.

Only the global rank 0 writes (pass ``enabled=False`` elsewhere). W&B is imported lazily
and runs offline unless credentials are configured, so a run never needs the network.
"""

from __future__ import annotations

import errno
import json
import math
import os
import resource
from typing import Any, Callable

from hdet_scale.config import WandbConfig
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.wandb_charts import ReplicaSeries
from hdet_scale.wandb_server import has_credentials, refuse_unreachable, run_mode


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # wandb 0.31's Settings.mode


def import_wandb(prefix: str = "wandb.") -> Any:
    """``import wandb``; an exception of its import becomes one :class:`HDETConfigError`
    naming the cause and the way out (with no usable temporary folder, W&B's import,
    which makes its media folder, would end ``hdet-train`` in a 30-line traceback).
    ``prefix``: the keys' place in the user's config, as in :func:`check_wandb_settings`."""
    try:
        import wandb as wb
    except Exception as e:  # noqa: BLE001 - whatever W&B's import raises, the user gets one line
        raise HDETConfigError(_wandb_import_failure(e, prefix)) from None
    return wb


def _wandb_import_failure(error: BaseException, prefix: str) -> str:
    """The line for ``error``, raised by ``import wandb``."""
    import tempfile

    try:
        tempfile.gettempdir()  # W&B's import makes a temporary folder: is there none to make it in?
        no_temp = None
    except OSError as e:  # "No usable temporary directory found in ['/x', '/tmp', ...]"
        no_temp = e.strerror or str(e)
    if no_temp is not None:
        limit = file_size_limit()
        return (f"{prefix}enabled=true, but W&B could not be imported: no temporary folder is writable ({no_temp}"
                f"{f'; the file size limit, ulimit -f, is {limit} bytes' if limit is not None else ''}); set TMPDIR "
                f"to a writable folder with free space{', raise ulimit -f' if limit is not None else ''}, "
                f"or set {prefix}enabled=false")
    reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    return (f"{prefix}enabled=true, but W&B could not be imported ({reason}): repair the wandb install "
            f"(pip install --force-reinstall wandb) or set {prefix}enabled=false")


def check_wandb_settings(wandb: WandbConfig, prefix: str = "wandb.") -> None:
    """Before a run starts: ``mode="online"`` (or ``WANDB_MODE=online`` with the mode
    unset) needs credentials, ``WANDB_MODE`` must be a mode W&B knows, and ``project`` a
    name W&B takes: otherwise W&B raises on rank 0 once training has started.
    ``prefix``: the keys' place in the user's config (``hdet.logging.wandb.`` in the
    library's block).

    Raises:
        HDETConfigError: no API key for an online run, ``WANDB_MODE`` not a W&B mode,
            ``WANDB_RUN_ID`` not an id W&B takes (``/``, ``:``...), an empty
            project name or one W&B refuses, W&B not installed (the ``[fsdp]`` extra leaves it
            out; rank 0 failed on the import), or W&B's import failing (no usable
            temporary folder: :func:`import_wandb`).
    """
    import importlib.util

    from hdet_scale.errors import HDETConfigError

    try:
        missing = wandb.enabled and importlib.util.find_spec("wandb") is None
    except ImportError:  # a broken install, or an import hook refusing it
        missing = True
    if missing:
        raise HDETConfigError(f'{prefix}enabled=true, but wandb is not installed: pip install "hdet-scale[wandb]", '
                              f"or set {prefix}enabled=false")
    env = os.environ.get("WANDB_MODE")
    if wandb.enabled and env is not None and env not in WANDB_MODES:
        raise HDETConfigError(f"environment: WANDB_MODE={env!r} is not a W&B mode; W&B takes "
                              f"{', '.join(WANDB_MODES)}: fix or unset it (or set {prefix}enabled=false)")
    if wandb.enabled and isinstance(wandb.project, str) and not wandb.project.strip():
        # wandb.project= (an unset shell variable) would run into the project "hdet",
        # the fallback below, without a word
        raise HDETConfigError(f"{prefix}project: empty ({wandb.project!r}; an unset shell variable?): give a W&B "
                              f"project name, or leave {prefix}project out for the default")
    if wandb.enabled and wandb.project is not None:
        # W&B's own rule (its Settings validator: no / \\ # ? % :, at most 128 characters),
        # met before any rank starts (else wandb.project=a/b fails at rank 0's wandb.init,
        # told to check the network)
        wb = import_wandb(prefix)

        try:
            wb.Settings(project=wandb.project)
        except Exception as e:  # noqa: BLE001 - W&B's UsageError, or pydantic's error around it
            reason = " ".join(str(e).split())[:300]
            raise HDETConfigError(f"{prefix}project: {reason}") from None
    run_id = os.environ.get("WANDB_RUN_ID", "").strip()
    if wandb.enabled and run_id:
        # W&B validates it in wandb.init, on rank 0 once training has started
        wb = import_wandb(prefix)
        try:
            wb.Settings(run_id=run_id)
        except Exception as e:  # noqa: BLE001 - W&B's UsageError, or pydantic's error around it
            raise HDETConfigError(f"environment: WANDB_RUN_ID={run_id!r} is not an id W&B takes "
                                  f"({' '.join(str(e).split())[:200]}): fix or unset it (or set "
                                  f"{prefix}enabled=false)") from None
    url = os.environ.get("WANDB_BASE_URL")
    if wandb.enabled and url is not None:
        # W&B validates it in wandb.init, on rank 0 after the start, offline runs too (a
        # pydantic traceback, exit 1, "start again with the same command")
        wb = import_wandb(prefix)
        try:
            wb.Settings(base_url=url)
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, or W&B's UsageError
            errors = getattr(e, "errors", None)
            reason = errors()[0].get("msg", str(e)) if callable(errors) and errors() else str(e)
            raise HDETConfigError(f"environment: WANDB_BASE_URL={url!r} is not a URL W&B takes "
                                  f"({' '.join(str(reason).split())[:200]}): set it to the W&B server's address "
                                  f"(http:// or https://), unset it, or set {prefix}enabled=false") from None
    if wandb.enabled and (wandb.mode or env) == "online" and not has_credentials():
        raise HDETConfigError(f"{prefix}mode=online, but no W&B API key is configured (WANDB_API_KEY, or `wandb login`); "
                              f"use {prefix}mode=offline (upload later with `wandb sync`), leave {prefix}mode unset (online "
                              f"when a key is configured, else offline), or {prefix}enabled=false")


def file_size_limit() -> int | None:
    """This process's file size limit in bytes (``RLIMIT_FSIZE``, ``ulimit -f``); ``None``:
    unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def size_limit_failure() -> tuple[str, str] | None:
    """``(what stopped a write, what to do first)`` for this process's finite file size
    limit; ``None`` without one."""
    limit = file_size_limit()
    if limit is None:
        return None
    return (f"a file reached the file size limit of this process (ulimit -f: {limit} bytes)",
            "raise the limit (ulimit -f unlimited)")


def write_failure(error: BaseException) -> tuple[str, str] | None:
    """``(what stopped a write that raised error, what to do first)``, in words, when it is
    a full disk (``ENOSPC``), a disk quota (``EDQUOT``), a file size limit (``EFBIG``:
    this process's ``ulimit -f``, or the file system's own), a read-only file system
    (``EROFS``) or a permission (``EACCES``, ``EPERM``); ``None`` otherwise."""
    code = getattr(error, "errno", None)
    if code == errno.EFBIG:
        return size_limit_failure() or ("a file reached the largest size its file system takes",
                                        "write to another file system")
    if code == errno.EDQUOT:
        return "the disk quota is exceeded", "free space within the quota (or have it raised)"
    if code == errno.ENOSPC:
        return DISK_FULL
    if code == errno.EROFS:  # a save into a folder made read-only is not a traceback
        return "its file system is read-only", "write to another file system"
    if code in (errno.EACCES, errno.EPERM):
        return "a file or folder there is not writable", "make it writable (chmod -R u+w on its folder)"
    return None


DISK_FULL = ("the disk is full", "free space")


def json_safe(value: Any, nonfinite: Any = str) -> Any:
    """``value`` (nested dicts / lists) with every NaN / inf float replaced by
    ``nonfinite(x)``: JSON has none. Metrics keep them readable (``"nan"``); a summary
    that strict readers parse writes ``null`` (``nonfinite=lambda x: None``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return nonfinite(value)
    if isinstance(value, dict):
        return {k: json_safe(v, nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, nonfinite) for v in value]
    return value


def last_logged_step(path: str, tail: int = 1 << 16) -> int | None:
    """The ``step`` of the last whole record in the JSONL file ``path`` (read from its
    last ``tail`` bytes), or ``None``: not a regular file, no record with a step,
    unreadable."""
    if not os.path.isfile(path):  # /dev/full (a test's full disk) reads zeros for ever
        return None
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read(tail).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a torn last line, or another JSON value
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def warn_on_earlier_records(path: str, step: int) -> None:
    """Warn when a run whose first record is at optimizer ``step`` appends to a JSONL file
    whose records already reach ``step`` or beyond: an earlier run's (a script run again
    with the same ``hdet.logging.jsonl``), or a dead run's past the checkpoint a resume
    starts from (appended without a word, ``hdet-plot`` would plot the first run alone).
    Nothing is removed: the file may be the user's only copy."""
    last = last_logged_step(path)
    if last is not None and last >= step:
        import warnings

        warnings.warn(f"hdet.logging.jsonl: {path} already holds records up to step {last} (an earlier run's?); "
                      f"this run's records from step {step} are appended after them, and hdet-plot reads the file "
                      "as one run: give each run its own file (nothing was removed)", UserWarning, stacklevel=3)


class MetricsLogger:
    """Writes metric records (flat dicts, keys like ``hdet/lr/replica_0/group_0``).

    Args:
        jsonl: path of the JSONL file, one record per line (``None``: no file).
        wandb: W&B settings; ``mode=None`` takes ``WANDB_MODE`` from the environment, else
            online with credentials, else offline.
            When this process already has a W&B run open (``wandb.run``, the user's),
            records go into that run (its settings here are then unused), the config is
            added under the keys it does not have yet, the step travels as ``hdet/step``
            (the x axis of the logged key namespaces) instead of W&B's own step, and
            :meth:`close` leaves the run open. Otherwise the logger opens its own run
            and finishes it at :meth:`close`.
        config: the fully resolved run config, attached to the W&B run.
        enabled: ``False`` on every rank but global rank 0.
        append: keep an existing JSONL file's records (a resumed run); ``False`` starts
            it anew. Appending records whose first step the file already reaches (an
            earlier run's file) warns (:func:`warn_on_earlier_records`).
        run_id: the id of the W&B run to continue (a resumed run: the id its checkpoint
            recorded, ``resume_config``), opened with ``resume="allow"`` so the curves go
            on in the same run; W&B keeps its step monotonic by dropping rows at steps it
            already holds, which a resumed run recomputes bit for bit anyway. ``None``:
            a new run. Unused when the user's own run is open. The file is opened at the first record, not here: a trainer can
            check its run folder on every rank after building the logger and before the
            first collective, and no rank sees a file another rank just created.
        advice: the way on that a failed write of the JSONL file (:meth:`log`) names, asked
            for when it fails (hdet-train: the checkpoint to resume from, or none).
        on_step: called with a record's optimizer step just before the record is written
            (hdet-train: the step its stop line names, so that no record is newer than the
            step a stop names, not "at step 69" beside a step-70 record).
    """

    def __init__(self, jsonl: str | None = None, wandb: WandbConfig | None = None,
                 config: dict | None = None, enabled: bool = True, append: bool = True,
                 run_id: str | None = None, advice: Callable[[], str] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.enabled = enabled
        self._advice = advice
        self._on_step = on_step
        self._file = None
        self._wandb_run = None
        self._defined: set[str] = set()  # key namespaces given hdet/step as x axis (user's run)
        self._own_run = False
        self._series = ReplicaSeries()
        self._jsonl, self._append = jsonl, append
        if not enabled:
            return
        if wandb is not None and wandb.enabled:
            wb = import_wandb()

            if wb.run is not None:
                # The user's own run (wandb.init before ours): log into it and leave it
                # open; finishing it ("finish_previous") would end their run under them.
                self._wandb_run = wb.run
                self._wandb_run.config.setdefaults(config or {})  # never overwrite their keys
                self.wandb_mode = "offline" if self._wandb_run.offline else "online"
                return
            # unset here: the user's WANDB_MODE, else online with credentials, else offline
            mode = run_mode(wandb.mode)
            # "create_new": another run this process holds (not wandb.run) stays untouched.
            # W&B waits 90 s for its server by default, then raises: an online run on a
            # node without network gets 30 s and one line naming the way
            # out. WANDB_INIT_TIMEOUT, when set, is the user's.
            settings = {} if "WANDB_INIT_TIMEOUT" in os.environ else {"settings": wb.Settings(init_timeout=30)}
            refuse_unreachable(mode)  # W&B's retries outlast init_timeout (88 s): seconds here
            try:
                project = wandb.project or os.environ.get("WANDB_PROJECT") or "hdet"  # WandbConfig
                self._wandb_run = wb.init(project=project, entity=wandb.entity, group=wandb.group,
                                          name=wandb.name, mode=mode, dir=wandb.dir, config=config or {},
                                          reinit="create_new", id=run_id, resume="allow" if run_id else None,
                                          **settings)
            except (wb.errors.Error, TimeoutError, OSError, ValueError) as e:  # ValueError: pydantic's
                reason = " ".join(str(e).split())[:300]
                fix = ("check the network and credentials, or set wandb.mode=offline (wandb sync uploads it later) "
                       "or wandb.enabled=false" if mode != "offline" else  # no network involved
                       "check the W&B settings (project, entity, group, name, dir) or set wandb.enabled=false")
                raise HDETConfigError(f"wandb: the {mode} W&B run could not start ({type(e).__name__}: {reason}); "
                                      f"{fix}") from None
            self._own_run = True
            self.wandb_mode = mode

    @property
    def run_id(self) -> str | None:
        """The id of the W&B run this logger opened (``None``: none, or the user's)."""
        return self._wandb_run.id if self._wandb_run is not None and self._own_run else None

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        """Write one record. ``step``: optimizer step (W&B's x axis).

        Raises:
            HDETStateError: the JSONL file could not be written for a full disk, a disk
                quota or a file size limit (:func:`write_failure`), naming the file, the
                cause and ``advice`` (not rank 0's OSError traceback).
        """
        if not self.enabled:
            return
        if step is not None and self._on_step is not None:
            self._on_step(step)
        try:
            if self._file is None and self._jsonl:
                os.makedirs(os.path.dirname(os.path.abspath(self._jsonl)), exist_ok=True)
                if self._append and step is not None:
                    warn_on_earlier_records(self._jsonl, step)
                self._file = open(self._jsonl, "a" if self._append else "w", buffering=1)
            if self._file is not None:
                out = {"step": step, **record} if step is not None else dict(record)
                self._file.write(json.dumps(json_safe(out)) + "\n")
        except OSError as e:
            raise self._write_error(e) from None
        if self._wandb_run is not None:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            if "hdet/sync" in record and step is not None:
                self._series.add(scalars, step)
            # The optimizer step travels as hdet/step, the x axis (define_metric) of every
            # key namespace we log, in our own run and in the user's alike.
            if step is not None:
                scalars = {"hdet/step": step, **scalars}
            self._define(scalars)
            if self._own_run:
                self._wandb_run.log(scalars, step=step)
            else:
                # As the Hugging Face Trainer and Lightning do in a run they did not open:
                # no step= (W&B drops rows whose step is below the run's current one, so
                # ours and the user's would fight over the counter).
                self._wandb_run.log(scalars)

    def _write_error(self, error: OSError) -> BaseException:
        """What a failed write of the JSONL file raises: :class:`HDETStateError` for a full
        disk, a quota or a file size limit; ``error`` itself otherwise."""
        failure = write_failure(error)
        if failure is None:
            return error
        cause, fix = failure
        path = self._jsonl
        if self._file is not None:
            # the line left in its buffer would fail again at close(), with this error said
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        self._jsonl = None  # nothing more is written
        reason = " ".join(str(error).split())[:200]
        advice = f" {self._advice()}" if self._advice is not None else ""
        return HDETStateError(f"metrics: writing {path} failed, {cause} ({type(error).__name__}: {reason}); "
                              f"{fix} first.{advice}")

    def _define(self, scalars: dict[str, Any]) -> None:
        for prefix in sorted({k.split("/")[0] for k in scalars if "/" in k} - self._defined):
            if not self._defined:
                self._wandb_run.define_metric("hdet/step")
            self._wandb_run.define_metric(f"{prefix}/*", step_metric="hdet/step")
            self._defined.add(prefix)

    def summary(self, values: dict[str, Any]) -> None:
        if self._wandb_run is not None:
            for k, v in values.items():
                self._wandb_run.summary[k] = v

    def close(self) -> None:
        """Raises:
            HDETStateError: as :meth:`log`, for the last flush of the JSONL file.
        """
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                raise self._write_error(e) from None
            self._file = None
        self._jsonl = None  # a closed logger writes nothing more
        if self._wandb_run is not None:
            self._series.log_charts(self._wandb_run)
            if self._own_run:
                self._wandb_run.finish()  # a run the user opened is theirs to finish
            self._wandb_run = None
