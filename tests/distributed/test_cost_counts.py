"""The cost model's bytes (hdet_scale/cost.py) against the bytes real collectives carry.

One launch of 4 gloo ranks (``cost_workers.count_worker``): at 2 x 2 and 4 x 1, DeepSpeed
ZeRO-3 and FSDP2, fp32 and bf16 with fp32 masters, gradient_sharing "global", a counting
shim over ``torch.distributed``'s collectives records what one training step and one
converge put on the replica group. The model's prediction is computed here from the
parameter shapes alone. Tolerance: none, bytes are counted exactly (payload convention of
hdet_scale/cost.py: the bytes of the tensors each rank hands to the all-reduces), on
every rank: the model's figure is rank 0's, and the shares of the two shard ranks differ
for FSDP2's uneven dim-0 chunks, so ranks with a smaller shard send less (checked: never
more).
"""

from __future__ import annotations

import functools
import math

import pytest

pytest.importorskip("deepspeed")

import cost_workers
import rank_tools

from hdet_scale.cost import ModelSize, estimate

LAUNCH_TIMEOUT = 300
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)


def _predicted(case: str, rec: dict) -> dict:
    backend, precision, layout = case.split()
    replicas = 4 // int(layout.split("x")[1])
    size = ModelSize(sum(math.prod(s) for s in rec["shapes"]),
                     tuple(tuple(s) for s in rec["shapes"]), rec["buffer_numel"])
    cost = estimate(size, backend=backend, precision=precision, world_size=4, replicas=replicas,
                    gradient_sharing="global", sync_interval=1000)
    by = {t.what.split(" (")[0]: t.payload for t in cost.transfers}
    return {"grad": by["gradient sharing"], "converge": by["converge"]}


def test_bytes_on_the_replica_group_match_the_model_exactly():
    """Gradient sharing (DeepSpeed: HDET's hook on the flat gradient partition; FSDP2:
    HSDP's all-reduce) and converge: the summed payload of the all-reduces on the replica
    group equals the model's prediction, byte for byte, on rank 0; on every rank it is at
    most that (rank 0 holds the largest shard); the 2 x 2 FSDP2 model has uneven dim-0
    chunks and odd sizes, so padding rules are exercised."""
    res = launch(cost_workers.count_worker)
    assert len(res[0]) == 8
    for case, rec in res[0].items():
        want = _predicted(case, rec)
        for kind in ("grad", "converge"):
            got = [sum(r[case][kind]) for r in res]
            assert got[0] == want[kind], f"{case} {kind}: counted {res[0][case][kind]}, model {want[kind]}"
            assert max(got) <= want[kind], f"{case} {kind}: {got}"
