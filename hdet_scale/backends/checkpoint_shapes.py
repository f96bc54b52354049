"""Which model tensors a checkpoint holds, read without their data, compared with the
model about to load it: a checkpoint of another model (another width, fewer layers) is
refused by name before the load, on every rank alike. Without it FSDP2 loaded a smaller
model from a larger checkpoint silently (DCP loads the keys it is asked for), and DDP,
fairscale and DeepSpeed failed in every rank with torch's state-dict traceback."""

from __future__ import annotations

import os
from typing import Any

import torch

from hdet_scale.backends.safe_load import dcp_metadata, load as safe_load
from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError

MODEL_FILE = "model_optim.pt"  # the ddp backend's file per replica: model and optimizer state

_SHOWN = 3  # differing tensors named per kind


def saved_model_shapes(backend: str, folder: str) -> dict[str, tuple[int, ...]] | None:
    """The model tensors ``{name: shape}`` that ``backend``'s checkpoint folder
    ``replica_<r>/<tag>`` holds, read without their data (``torch.load`` memory-mapped;
    FSDP2: DCP's ``.metadata``; DeepSpeed: the ``param_shapes`` its model-states file
    records, ZeRO-3 keeping no shapes in the module state itself). ``None`` when they
    cannot be read (a file missing, damaged or of another program: the load then names
    it, not this check), or when the file read is not the size the folder's manifest
    records (another file in its place: the load's manifest check names it exactly)."""
    from hdet_scale.backends.manifest import MANIFEST_FILE

    def read(name: str) -> str:
        path = os.path.join(folder, name)
        if os.path.exists(os.path.join(folder, MANIFEST_FILE)):
            with open(os.path.join(folder, MANIFEST_FILE)) as f:
                if json_load(f)["files"][name][0] != os.path.getsize(path):
                    raise ValueError(f"{path} is not the file this checkpoint saved there")
        return path

    def archive(name: str) -> Any:
        return safe_load(read(name), map_location="cpu", mmap=True)

    try:
        if backend == "fsdp2":
            read(".metadata")
            meta = dcp_metadata(folder).state_dict_metadata
            return {k[len("model."):]: tuple(v.size) for k, v in meta.items()
                    if k.startswith("model.") and hasattr(v, "size")}
        if backend == "deepspeed":
            states = archive(sorted(n for n in os.listdir(folder) if n.endswith("model_states.pt"))[0])
            if not states.get("param_shapes"):  # not saved by a ZeRO optimizer: the strict load compares
                return None
            shapes: dict = {}
            for group in states["param_shapes"]:
                shapes.update(group)
            shapes.update(states.get("frozen_param_shapes") or {})
        elif backend == "ddp":
            shapes = archive(MODEL_FILE)["model"]
        else:  # fairscale: the whole model, written by shard 0 of each replica
            shapes = archive("model.pt")
        return {str(k): tuple(v.shape if isinstance(v, torch.Tensor) else v) for k, v in shapes.items()}
    except Exception:  # noqa: BLE001 - unreadable: the load reads it and names what is wrong
        return None


def shape_difference(saved: dict[str, tuple[int, ...]], built: dict[str, tuple[int, ...]]) -> str | None:
    """How the checkpoint's tensors ``saved`` differ from this run's ``built`` (the first
    few of each kind), or ``None`` when they are the same names and shapes."""
    extra = [k for k in saved if k not in built]
    lacking = [k for k in built if k not in saved]
    other = [k for k in built if k in saved and tuple(saved[k]) != tuple(built[k])]

    def first(keys: list[str], show: Any = str) -> str:
        more = f", ... ({len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
        return ", ".join(show(k) for k in keys[:_SHOWN]) + more

    def shapes(k: str) -> str:
        return f"{k}: checkpoint {list(saved[k])}, this run {list(built[k])}"

    parts = []
    if other:
        parts.append(f"{len(other)} of another shape ({first(other, shapes)})")
    if extra:
        parts.append(f"{len(extra)} in the checkpoint that this run's model lacks ({first(extra)})")
    if lacking:
        parts.append(f"{len(lacking)} of this run's model that the checkpoint lacks ({first(lacking)})")
    return "; ".join(parts) or None


def agreed_difference(backend: str, folder: str | None, built: dict[str, tuple[int, ...]],
                      topology: Any) -> str | None:
    """How the checkpoint folder ``folder`` (this rank's ``replica_<r>/<tag>``; ``None``:
    none to read) differs from ``built`` (this rank's model, ``{name: full shape}``), as
    the first rank that found a difference says, or ``None`` on every rank. Collective
    on ``topology.world_group`` (one ``all_gather_object``): every rank calls it, so a
    rank that could not read its files (it leaves them to the load, which names a damaged
    file) never waits alone in the load's collectives while another raises."""
    import torch.distributed as dist

    saved = saved_model_shapes(backend, folder) if folder is not None else None
    mine = shape_difference(saved, built) if saved is not None else None
    found: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(found, mine, group=topology.world_group)
    return next((f for f in found if f), None)


def refuse_other_model(backend: str, load_dir: str, tag: str, folder: str, built: dict[str, tuple[int, ...]],
                       topology: Any) -> None:
    """Every backend's ``load_checkpoint``, before anything is loaded: raise
    ``HDETStateError`` on every rank alike when the checkpoint's model tensors differ from
    ``built`` (:func:`agreed_difference`; collective on the world group). Without it the
    library's DDP load of another width is torch's state-dict traceback on every rank
    (hdet-train and FSDP2 refuse it)."""
    from hdet_scale.errors import HDETStateError

    difference = agreed_difference(backend, folder, built, topology)
    if difference:
        raise HDETStateError(f"the checkpoint {load_dir}/replica_*/{tag} holds another model than the one loading "
                             f"it: {difference}")
