"""The model built sharded gives the weights of the model built whole.

DeepSpeed: built under ``hdet_scale.zero_init`` (``deepspeed.zero.Init`` on the shard
group), each rank holds ``ceil(n / S)`` elements of every parameter from construction on.
FSDP2: built with its parameters on the meta device, sharded, then ``init_weights`` fills
each rank's shard. Both against ``build_model`` on one rank with the same seed: the
trainer's init draws every element from a stream keyed by (seed, parameter, block), so the
two must agree bit for bit (tolerance 0); the forward losses then agree to float32
rounding of the sharded forward (rel 1e-6: ZeRO-3 / FSDP2 compute on gathered copies of
the same values, the same kernels).
"""

from __future__ import annotations

import math

import pytest

import sharded_init_workers as W
from harness import run_ranks

pytestmark = pytest.mark.timeout(600)


def test_zero_init_on_the_shard_group_equals_the_whole_build():
    pytest.importorskip("deepspeed")
    res = run_ranks(W.deepspeed_worker, 4, timeout=300)
    for r in res:
        assert r["shard_size"] == 2
        assert "hdet.replicas=4" in r["mismatch"] and "built for 2 replicas" in r["mismatch"]
        assert r["max_diff"] == 0.0
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-6)
        for name, (held, full, local) in r["held"].items():
            assert full > 0 and local == 0, name  # nothing whole on the rank
            assert held == math.ceil(full / 2), name  # 1/S of it, padded


@pytest.mark.parametrize("gradient_sharing", ["global", "replica"])
def test_fsdp2_meta_device_build_equals_the_whole_build(gradient_sharing):
    res = run_ranks(W.fsdp2_worker, 4, args=(gradient_sharing,), timeout=300)
    for r in res:
        assert r["meta"]
        assert "hdet.replicas=4" in r["mismatch"] and "init_weights" in r["no_init"]
        assert r["max_diff"] == 0.0 and r["buffer_diff"] == 0.0
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-6)
    # the shards of one replica add up to the model, each rank holding about half
    assert res[0]["local"] + res[1]["local"] == res[0]["full"]
    assert all(abs(r["local"] - r["full"] / 2) < r["full"] * 0.05 for r in res)
