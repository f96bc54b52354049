"""Checkpoint files read without running code.

A ``torch.save`` file and DCP's ``.metadata`` are pickles, and unpickling calls whatever
the file names: a checkpoint from a shared bucket or a download could run code on the
resuming machine. Every file a resume reads is therefore read here first with a loader
that builds only data:

* ``torch.save`` archives (HDET's ``hdet_shard_<s>.pt``, DDP's ``model_optim.pt``,
  fairscale's ``model.pt`` / ``oss_shard_<s>.pt``, DeepSpeed's ``*_model_states.pt`` /
  ``*_optim_states.pt``): ``torch.load(weights_only=True)`` (torch's own restricted
  unpickler: tensors, containers, numbers, strings) with :data:`DEEPSPEED_TYPES` added
  for DeepSpeed's files. The project's own files are loaded that way (:func:`load`);
  DeepSpeed's engine then loads its files with full unpickling, so they are read here
  first (:func:`unsafe_problem`, memory-mapped: the pickle is parsed, the tensor bytes are
  not read).
* DCP (FSDP2): ``.metadata`` through :class:`_MetadataUnpickler` (DCP's metadata classes,
  ``torch.Size``, dtypes, paths) instead of DCP's ``pickle.load`` (:func:`dcp_metadata`),
  and each non-tensor item of the ``.distcp`` files (which DCP's planner loads with
  ``weights_only=False``) with ``torch.load(weights_only=True)``. DCP reads tensors with
  ``weights_only=True`` itself.

Trust model (docs/failure_semantics.md): a checkpoint is data. One that names any other
callable is refused, on every rank, before anything is loaded, naming the file and what it
refused. What is not covered: a file swapped between this check and the engine's own read
(the folder must not be writable by others while a resume starts), and the values
themselves (a crafted checkpoint can still hold bad weights).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
import warnings
import zipfile
from typing import Any

import torch

from hdet_scale.errors import HDETUntrustedFileError

#: DeepSpeed's types in its optimizer states (ZeRO's loss scaler and stage enum),
#: ``(module, name)``: added to torch's restricted unpickler when DeepSpeed is imported.
DEEPSPEED_TYPES = (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                   ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                   ("deepspeed.runtime.zero.config", "ZeroStageEnum"))

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


def _extra_globals() -> list[Any]:
    import importlib

    if "deepspeed" not in sys.modules:
        return []
    found = []
    for module, name in DEEPSPEED_TYPES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: its files name what they hold
            continue
    return found


def _first_reference(source: Any) -> str | None:
    """The first ``module.name`` that the pickle ``source`` (a path or a ``BytesIO``; a
    ``torch.save`` archive's ``data.pkl``) names outside torch's restricted set, read
    with ``pickletools`` (no object is built). For the message only: torch refuses some
    files by an opcode (a plain ``pickle.dump`` file's FRAME) before it reaches a global."""
    import pickletools

    try:
        if isinstance(source, io.BytesIO):
            data = source.getvalue()
        elif zipfile.is_zipfile(source):
            with zipfile.ZipFile(source) as z:
                data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        else:
            with open(source, "rb") as f:
                data = f.read()
        from torch._weights_only_unpickler import _get_allowed_globals  # what torch admits itself

        allowed = set(_get_allowed_globals()) | {
            f"{g.__module__}.{g.__qualname__}" for g in [*torch.serialization.get_safe_globals(), *_extra_globals()]
            if hasattr(g, "__qualname__")}
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and "UNICODE" in op.name:
                strings.append(arg)
            ref = (arg.replace(" ", ".") if op.name in ("GLOBAL", "INST") else
                   ".".join(strings[-2:]) if op.name == "STACK_GLOBAL" and len(strings) >= 2 else None)
            if ref and ref not in allowed:
                return ref
    except Exception:  # noqa: BLE001 - a damaged or unusual pickle: the message says what torch said
        return None
    return None


def _refused(path: str, e: Exception, source: Any = None) -> HDETUntrustedFileError | None:
    """The refusal for ``path`` when ``e`` is torch's restricted unpickler refusing what
    the file holds; ``None`` for any other error (a damaged file: the checksum checks and
    the load name it). ``source``: the file or bytes, to name the reference when torch
    names none."""
    text = str(e)
    if not isinstance(e, pickle.UnpicklingError) or "Weights only load failed" not in text:
        return None
    # torch words it "Unsupported global: GLOBAL m.f was not an allowed global" or "Trying
    # to load unsupported GLOBAL m.f whose module m is blocked", by version and module
    match = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", text)
    named = match.group(1).rstrip(".") if match else _first_reference(source)
    if named:
        return untrusted(path, f"a reference to {named}")
    # another refusal (an opcode, a call): torch's middle paragraph says which
    said = [p.strip().removeprefix("WeightsUnpickler error:").strip() for p in text.split("\n\n")
            if p.strip() and not p.strip().startswith(("Weights only load failed", "Check the documentation"))]
    return untrusted(path, f"what torch's safe loader refuses ({(said or ['no reason given'])[0][:200]})")


def untrusted(path: str, what: str) -> HDETUntrustedFileError:
    """The one refusal message for a checkpoint file holding ``what``."""
    return HDETUntrustedFileError(
        f"checkpoint file {path} holds {what}, which is not checkpoint data: loading it could run code, so "
        "nothing was loaded. Resume from a checkpoint you trust (written by hdet_scale, not changed since), or "
        "start a new run_dir; if you wrote this file yourself and trust it, load it outside hdet_scale")


def load(path: str | io.BytesIO, *, name: str | None = None, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, **kwargs)``, with DeepSpeed's types allowed
    when DeepSpeed is imported: never runs code from the file. ``name``: what a refusal
    calls the file (default ``path``).

    Raises:
        HDETUntrustedFileError: the file names a callable or type outside torch's
            restricted set (the message names the file and the reference).
        Anything else ``torch.load`` raises (a damaged file), unchanged.
    """
    try:
        with torch.serialization.safe_globals(_extra_globals()), warnings.catch_warnings():
            # a file torch.save did not write: its protocol is refused below with a message of ours
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        refused = _refused(name or str(path), e, path)
        if refused is None:
            raise
        raise refused from None


class _MetadataUnpickler(pickle.Unpickler):
    """A DCP ``.metadata`` pickle: DCP's metadata classes and plain values only."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Weights only load failed. WeightsUnpickler error: Unsupported global: "
                                     f"GLOBAL {module}.{name}")


def dcp_metadata(folder: str) -> Any:
    """DCP's ``Metadata`` of the checkpoint ``folder``, read from its ``.metadata``
    without running code (DCP's ``FileSystemReader.read_metadata`` is ``pickle.load``).

    Raises:
        HDETUntrustedFileError: ``.metadata`` names anything but DCP's metadata classes,
            ``torch.Size``, dtypes, layouts and paths.
        OSError, and what unpickling a damaged file raises, unchanged.
    """
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            refused = _refused(path, e, path)
            if refused is None:
                raise
            raise refused from None


def _dcp_items_problem(folder: str) -> str | None:
    """The first non-tensor item of the DCP checkpoint ``folder`` that torch's safe loader
    refuses (DCP's planner loads these with ``weights_only=False``), as the refusal text."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = dcp_metadata(folder)
    storage = meta.storage_data or {}
    root = os.path.realpath(folder)
    for index, info in storage.items():
        # DCP joins the item's path to the folder as given: an absolute or "../" path
        # would read any file on the machine as checkpoint data
        rel = str(getattr(info, "relative_path", ""))
        if os.path.dirname(os.path.realpath(os.path.join(folder, rel))) != root:
            return (f"checkpoint file {os.path.join(folder, '.metadata')} points item "
                    f"{getattr(index, 'fqn', index)!r} at {rel or 'no file'}, outside the checkpoint's folder, "
                    "so nothing was loaded: a checkpoint reads only its own files. Resume from a checkpoint you "
                    "trust (written by hdet_scale, not changed since), or start a new run_dir")
    for fqn, item in sorted(meta.state_dict_metadata.items()):
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = storage.get(MetadataIndex(fqn))
        if info is None or getattr(info, "transform_descriptors", None):
            continue  # compressed items: DCP decodes them itself; nothing loads them unchecked here
        path = os.path.join(folder, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        try:
            load(blob, name=f"{path} (item {fqn!r})", map_location="cpu")
        except HDETUntrustedFileError as e:
            return str(e)
        except Exception:  # noqa: BLE001 - a damaged item: the checksum checks and the load name it
            continue
    return None


def unsafe_problem(path: str) -> str | None:
    """The refusal text for the checkpoint file ``path`` when reading it could run code,
    else ``None``: a ``torch.save`` archive (memory-mapped: its tensor bytes stay on
    disk) or a legacy torch pickle (``.pt``, ``.pth``, ``.bin``) through torch's safe
    loader; a DCP ``.metadata`` through :func:`dcp_metadata` and then every non-tensor item
    it lists. Other files (JSON, text, DCP's tensor data) are not unpickled by any resume
    and pass. A damaged file passes too: the checksum checks name it."""
    name = os.path.basename(path)
    try:
        if name == ".metadata":
            return _dcp_items_problem(os.path.dirname(path))
        if zipfile.is_zipfile(path) and not name.endswith(".distcp"):
            load(path, map_location="cpu", mmap=True)
        elif name.endswith((".pt", ".pth", ".bin")):
            load(path, map_location="cpu")
    except HDETUntrustedFileError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - a damaged file: named by the checks built for that
        return None
    return None


def folder_problem(folder: str, part: int = 0, parts: int = 1) -> str | None:
    """:func:`unsafe_problem` for the files ``part, part + parts, ...`` of ``folder``'s
    sorted listing (each rank of a shard group its share): the first refusal, or ``None``."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names[part::parts]:
        problem = unsafe_problem(os.path.join(folder, name))
        if problem:
            return problem
    return None


#: The files of a ``Trainer`` checkpoint (``checkpoint-N/``) that ``Trainer`` reads back on
#: a resume. transformers loads them with ``weights_only=True`` itself; they are read here
#: first so that a crafted one is refused with the same message before HDET loads
#: anything. ``training_args.bin`` is not among them: ``Trainer`` writes it and never
#: reads it back (it pickles a ``TrainingArguments`` object).
TRAINER_FILES = re.compile(r"^(rng_state(_\d+)?\.pth|optimizer\.pt|scheduler\.pt|scaler\.pt)$")


def refuse_untrusted_trainer_files(checkpoint_dir: str) -> None:
    """Every file of :data:`TRAINER_FILES` in ``checkpoint_dir`` through
    :func:`unsafe_problem`, with the numpy types transformers allows for its RNG state
    (``trainer_pt_utils.safe_globals``). Every rank reads the same files, so all raise alike, without
    a collective.

    Raises:
        HDETUntrustedFileError: the first file that names code to run on load.
    """
    from transformers.trainer_pt_utils import safe_globals as trainer_globals  # numpy's RNG state

    names = sorted(n for n in os.listdir(checkpoint_dir) if TRAINER_FILES.match(n)) \
        if os.path.isdir(checkpoint_dir) else []
    for name in names:
        with trainer_globals():
            problem = unsafe_problem(os.path.join(checkpoint_dir, name))
        if problem:
            raise HDETUntrustedFileError(problem)
