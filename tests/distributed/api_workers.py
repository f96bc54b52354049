"""Rank side of test_api: the README's one loop (``hdet_scale.prepare``) on every engine.

Each rank runs, for each backend in turn, the same loop on TinyNet (rank_tools): 4
optimizer steps of 2 micro-batches each (gradient accumulation 2), a checkpoint after
step 2, then a new model and ``Ensemble`` that loads it and runs steps 3 and 4 again.
Batches are seeded by (rank, step, micro-batch), so every engine sees the same data.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import rank_tools
from hdet_scale.errors import HDETResumeWarning
from rank_tools import D_IN, D_OUT, LR, MICRO, WORLD

BACKENDS = ("ddp", "fairscale", "fsdp2", "deepspeed")
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
          "train_batch_size": MICRO * 2 * WORLD, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.0}},
          "hdet": rank_tools.hdet_block(sync_interval=2, logging={"jsonl": None, "wandb": {"enabled": False}})}


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_tools.seeded_batch(50_000 + 1_000 * rank_tools.rank() + 10 * step + micro, MICRO, D_IN, D_OUT)


def train_steps(ens: Any, first: int, last: int) -> list[float]:
    """Optimizer steps ``first..last`` of the README loop; each step's loss (mean of its
    micro-batches) as this rank recorded it."""
    losses = []
    for step in range(first, last + 1):
        total = 0.0
        for micro in range(ens.grad_accum):
            x, y = batch(step, micro)
            with ens.accumulate():
                loss = F.mse_loss(ens.model(x), y)
                ens.backward(loss)
            total += float(loss)
            assert ens.step() == (micro == ens.grad_accum - 1)
        losses.append(total / ens.grad_accum)
    return losses


def weights(ens: Any) -> np.ndarray:
    """Every parameter of this rank's replica, whole (gathered where sharded)."""
    if ens.backend == "deepspeed":
        import deepspeed

        params = list(ens.model.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().flatten() for p in params]).numpy().copy()
    if ens.backend == "fsdp2":
        return torch.cat([p.full_tensor().detach().flatten() for p in ens.model.parameters()]).numpy()
    return torch.cat([p.detach().flatten() for p in ens.model.module.parameters()]).numpy()


class Payload:
    """What a crafted checkpoint holds: unpickled, it creates the folder ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.mkdir, (self.marker,)


#: per engine, the kinds of file a resume reads in a replica folder: ``(name, how)``;
#: how: "archive" (the file replaced by a torch.save archive holding the payload),
#: "pickle" (a plain pickle: DCP's .metadata), "item" (one non-tensor DCP item in a
#: .distcp file replaced, .metadata pointing at it: its own types stay DCP's)
CRAFTED = {"ddp": [("hdet_shard_0.pt", "archive"), ("model_optim.pt", "archive")],
           "fairscale": [("hdet_shard_1.pt", "archive"), ("model.pt", "archive"), ("oss_shard_1.pt", "archive")],
           "fsdp2": [("hdet_shard_0.pt", "archive"), (".metadata", "pickle"), ("__1_0.distcp", "item")],
           "deepspeed": [("hdet_shard_1.pt", "archive"), ("zero_pp_rank_1_mp_rank_00_model_states.pt", "archive"),
                         ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "archive")]}


def _craft(folder: str, name: str, how: str, marker: str) -> list[str]:
    """Replace ``name`` in ``folder`` by a file whose load runs the payload, and update the
    folder's manifest to match it (a crafted checkpoint arrives with consistent metadata).
    Returns the files changed (to restore)."""
    import dataclasses
    import io
    import pickle

    from hdet_scale.backends.manifest import digest
    from hdet_scale.backends.safe_load import dcp_metadata
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    changed = [name]
    if how == "archive":
        torch.save({"scheduler": Payload(marker), "model": {}, "optimizer": {}}, os.path.join(folder, name))
    elif how == "pickle":
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(Payload(marker), f)
    else:
        meta = dcp_metadata(folder)
        fqn = sorted(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
                     and meta.storage_data[MetadataIndex(k)].relative_path == name)[0]
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        path = os.path.join(folder, name)
        offset = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(buf.getvalue())
        info = meta.storage_data[MetadataIndex(fqn)]
        meta.storage_data[MetadataIndex(fqn)] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
        changed.append(".metadata")
    manifest = os.path.join(folder, "hdet_manifest.json")
    with open(manifest) as f:
        record = json.load(f)
    for n in changed:
        record["files"][n] = digest(os.path.join(folder, n))
    with open(manifest, "w") as f:
        json.dump(record, f)
    return [*changed, "hdet_manifest.json"]


def crafted_loads(ens: Any, save_dir: str, tag: str, tmp: str) -> dict:
    """For each kind of file of this engine (``CRAFTED``): rank 0 replaces it in replica
    1's folder (rank 0 itself reads replica 0's: the refusal must reach every rank), every
    rank calls ``ens.load_checkpoint``, rank 0 puts the file back. Returns
    ``{name: (error type, message, payload ran)}``; ``ens`` is then loaded cleanly by the
    caller, whose resumed run must equal the uninterrupted one (nothing was loaded)."""
    import torch.distributed as dist

    folder = os.path.join(save_dir, "replica_1", tag)
    out = {}
    for i, (name, how) in enumerate(CRAFTED[ens.backend]):
        marker = os.path.join(tmp, f"ran_{ens.backend}_{i}")
        dist.barrier()
        if rank_tools.rank() == 0:
            kept = {n: open(os.path.join(folder, n), "rb").read() for n in os.listdir(folder)}
            changed = _craft(folder, name, how, marker)
        dist.barrier()
        try:
            ens.load_checkpoint(save_dir)
            seen = ("loaded", "", False)
        except Exception as e:  # noqa: BLE001 - the test names what was raised
            seen = (type(e).__name__, str(e), False)
        dist.barrier()
        seen = (*seen[:2], os.path.exists(marker))
        if rank_tools.rank() == 0:
            for n in changed:
                with open(os.path.join(folder, n), "wb") as f:
                    f.write(kept[n])
        out[name] = seen
    dist.barrier()
    return out


def run(tmp: str) -> dict:
    import hdet_scale

    rank_tools.init_dist()
    torch.set_num_threads(1)
    out = {}
    for backend in BACKENDS:
        ens = hdet_scale.prepare(rank_tools.build_model(), copy.deepcopy(CONFIG), backend=backend)
        first = train_steps(ens, 1, 2)
        tag = ens.save_checkpoint(f"{tmp}/{backend}")
        rest = train_steps(ens, 3, 4)
        final = weights(ens)
        again = hdet_scale.prepare(rank_tools.build_model(), copy.deepcopy(CONFIG), backend=backend)
        crafted = crafted_loads(again, f"{tmp}/{backend}", tag, tmp)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loaded = again.load_checkpoint(f"{tmp}/{backend}")
        # other betas and eps than the checkpoint's: the load keeps the checkpoint's, and
        # says so
        changed = copy.deepcopy(CONFIG)
        changed["optimizer"]["params"].update(betas=[0.5, 0.6], eps=1e-6)
        other = hdet_scale.prepare(rank_tools.build_model(), changed, backend=backend)
        with warnings.catch_warnings(record=True) as kept:
            warnings.simplefilter("always")
            other.load_checkpoint(f"{tmp}/{backend}")
        resume_warnings = {"same": [str(w.message) for w in seen if issubclass(w.category, HDETResumeWarning)],
                           "changed": [str(w.message) for w in kept if issubclass(w.category, HDETResumeWarning)],
                           "betas_after": [list(g["betas"]) for g in other.optimizer.param_groups]}
        del other
        resumed = train_steps(again, 3, 4)
        out[backend] = {"losses": first + rest, "final": final, "tag": tag, "loaded": loaded,
                        "resumed_losses": resumed, "resumed": weights(again),
                        "lr": again.scheduler.get_last_lr()[0], "step": again.scheduler.step_count,
                        "resume_warnings": resume_warnings, "crafted": crafted,
                        "replica": again.topology.replica_index}
        # step 5 is no sync (T = 2): the replicas part; Ensemble.converge joins them (a
        # loop that stops before total_steps)
        train_steps(again, 5, 5)
        out[backend]["apart"] = weights(again)
        again.converge()
        out[backend]["converged"] = weights(again)
        # each rank builds other weights (a user seeding by rank): prepare must start
        # every replica from one model all the same, DeepSpeed included
        # fc1 frozen (a frozen embedding, a LoRA base): DeepSpeed's optimizer does not
        # hold it, and the start copy must cover it too
        model = rank_tools.build_model(seed=100 + rank_tools.rank())
        model.fc1.requires_grad_(False)
        apart = hdet_scale.prepare(model, copy.deepcopy(CONFIG), backend=backend)
        out[backend]["seeded_apart"] = weights(apart)
    return out
