"""Unit tests for hdet_scale.controller (softmax weights, hypergradient, meta-update,
derived decay) against hand arithmetic."""

from __future__ import annotations

import math

import pytest

from hdet_scale.controller import Weights, derive_decay, hypergradient, meta_update, softmax_weights
from hdet_scale.errors import HDETConfigError

NAN, INF = float("nan"), float("inf")


def test_softmax_two_replicas_by_hand():
    w = softmax_weights([1.0, 1.1], 0.1)
    # mean 1.05 -> scores (1.05 - L) / 0.1 = [0.5, -0.5]
    e_p, e_m = math.exp(0.5), math.exp(-0.5)
    assert w.weights == pytest.approx([e_p / (e_p + e_m), e_m / (e_p + e_m)], rel=1e-12)
    assert w.weights[0] == pytest.approx(1 / (1 + math.exp(-1.0)), rel=1e-12)
    assert w.finite == [True, True]
    assert sum(w.weights) == pytest.approx(1.0, abs=1e-15)


def test_softmax_four_replicas_by_hand():
    losses = [2.0, 2.3, 1.9, 2.2]
    sigma = 0.25
    mean = sum(losses) / 4
    e = [math.exp((mean - x) / sigma) for x in losses]
    want = [x / sum(e) for x in e]
    got = softmax_weights(losses, sigma).weights
    assert got == pytest.approx(want, rel=1e-12)
    assert max(range(4), key=lambda r: got[r]) == 2  # lowest loss, biggest weight


def test_softmax_equal_losses_uniform_and_large_scores_stable():
    assert softmax_weights([3.0, 3.0, 3.0], 0.002).weights == pytest.approx([1 / 3] * 3, rel=1e-15)
    # a loss gap of 10 nats at sigma 0.002 -> score 2500: no overflow, one-hot
    w = softmax_weights([1.0, 11.0], 0.002).weights
    assert w == pytest.approx([1.0, 0.0], abs=1e-300)
    assert all(math.isfinite(x) for x in w)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_loss_gets_zero_weight_and_others_are_softmax(bad):
    w = softmax_weights([1.0, bad, 1.1], 0.1)
    assert w.finite == [True, False, True]
    assert w.weights[1] == 0.0
    # the other two: exactly the two-replica softmax of [1.0, 1.1] (mean over finite only)
    e_p, e_m = math.exp(0.5), math.exp(-0.5)
    assert w.weights[0] == pytest.approx(e_p / (e_p + e_m), rel=1e-12)
    assert w.weights[2] == pytest.approx(e_m / (e_p + e_m), rel=1e-12)
    assert sum(w.weights) == pytest.approx(1.0, abs=1e-15)
    assert all(math.isfinite(x) for x in w.weights)


def test_all_nonfinite_gives_zero_weights_and_zero_hypergradient():
    w = softmax_weights([NAN, INF, -INF], 0.1)
    assert w.weights == [0.0, 0.0, 0.0]
    assert w.finite == [False, False, False]
    assert hypergradient(w, [0.9, 1.0, 1.1]) == 0.0


def test_single_finite_replica_gets_all_weight():
    w = softmax_weights([NAN, 5.0], 0.1)
    assert w.weights == [0.0, 1.0]


def test_hypergradient_by_hand_and_sign():
    a = 1 / 9
    values = [1e-3 * (1 - a), 1e-3 * (1 + a)]  # replica 1 has the high LR
    # high-LR replica has the lower loss -> positive Delta
    w = softmax_weights([1.1, 1.0], 0.1)
    wl = 1 / (1 + math.exp(1.0))  # weight of the worse (low-LR) replica
    want = wl * values[0] + (1 - wl) * values[1] - (values[0] + values[1]) / 2
    d = hypergradient(w, values)
    assert d == pytest.approx(want, rel=1e-12)
    assert d > 0
    # by hand: Delta = 1e-3 * a * (w_high - w_low)
    assert d == pytest.approx(1e-3 * a * ((1 - wl) - wl), rel=1e-10)
    # swapped: the high-LR replica is worse -> negative
    assert hypergradient(softmax_weights([1.0, 1.1], 0.1), values) == pytest.approx(-want, rel=1e-12)
    # equal losses -> zero (up to rounding)
    assert hypergradient(softmax_weights([1.0, 1.0], 0.1), values) == pytest.approx(0.0, abs=1e-18)


def test_hypergradient_nonfinite_replica_keeps_its_place_in_the_mean():
    values = [0.9, 1.0, 1.1]
    w = Weights([0.5, 0.5, 0.0], [True, True, False])  # the high replica diverged
    assert hypergradient(w, values) == pytest.approx(0.5 * 0.9 + 0.5 * 1.0 - 1.0, rel=1e-15)
    assert hypergradient(w, values) < 0


def test_meta_update_by_hand():
    base, v, delta = 1e-3, 2e-5, -4e-5
    beta, lam, gamma = 0.9, 0.5, 0.05
    nb, nv = meta_update(base, v, delta, beta, lam, gamma)
    v_hand = 0.9 * 2e-5 + 0.1 * (-4e-5)  # 1.4e-5
    assert nv == pytest.approx(1.4e-5, rel=1e-12)
    assert nv == pytest.approx(v_hand, rel=1e-15)
    assert nb == pytest.approx(1e-3 * 0.95 + 0.5 * 1.4e-5, rel=1e-12)  # 9.57e-4
    assert nb == pytest.approx(9.57e-4, rel=1e-12)
    # zero velocity / delta / decay: base unchanged
    assert meta_update(0.3, 0.0, 0.0, 0.9, 0.5, 0.0) == (0.3, 0.0)


def test_meta_update_two_steps_by_hand():
    b, v = 1.0, 0.0
    b, v = meta_update(b, v, 0.2, 0.5, 2.0, 0.1)  # v = 0.1, b = 0.9 + 0.2 = 1.1
    assert (b, v) == pytest.approx((1.1, 0.1), rel=1e-15)
    b, v = meta_update(b, v, -0.4, 0.5, 2.0, 0.1)  # v = 0.05 - 0.2 = -0.15, b = 0.99 - 0.3
    assert (b, v) == pytest.approx((0.69, -0.15), rel=1e-14)


@pytest.mark.parametrize("start,floor,K", [(1.0, 1e-4, 90), (3e-4, 3e-4 / 25 / 1e4, 7), (2.0, 1.0, 1),
                                           (0.5, 0.4999, 1000)])
def test_derive_decay_reaches_floor(start, floor, K):
    gamma = derive_decay(start, floor, K)
    assert 0 <= gamma < 1
    assert (1 - gamma) ** K == pytest.approx(floor / start, rel=1e-12)
    # applying the decay K times to start lands on floor
    x = start
    for _ in range(K):
        x *= 1 - gamma
    assert x == pytest.approx(floor, rel=1e-11)


def test_derive_decay_hand_values():
    assert derive_decay(1.0, 0.25, 2) == pytest.approx(0.5, rel=1e-15)
    assert derive_decay(8.0, 1.0, 3) == pytest.approx(0.5, rel=1e-15)
    assert derive_decay(1.0, 0.5, 1) == pytest.approx(0.5, rel=1e-15)


def test_derive_decay_floor_equals_start_is_zero():
    assert derive_decay(0.01, 0.01, 5) == 0.0


@pytest.mark.parametrize("start,floor,K", [
    (1.0, 2.0, 10),    # floor above start: gamma < 0
    (1.0, 0.0, 10),    # floor 0
    (1.0, -1e-3, 10),  # negative floor
    (0.0, 0.0, 10),    # start 0
    (1.0, 0.1, 0),     # no sync left
    (1.0, 0.1, -3),
])
def test_derive_decay_rejects(start, floor, K):
    with pytest.raises(HDETConfigError) as e:
        derive_decay(start, floor, K)
    assert "hdet.auto.decay" in str(e.value)


def test_derive_decay_custom_key_in_message():
    with pytest.raises(HDETConfigError, match="my.key"):
        derive_decay(1.0, 2.0, 3, key="my.key")


def test_published_gamma_formula_is_negative_with_torch_defaults():
    div, final_div, K = 25.0, 1e4, 90
    published = 1 - math.exp(-math.log(div / final_div) / K)
    # 1 - 400 ** (1/90) ~= -0.0688: the base LR would grow by (1 - gamma)^K = 400x
    assert published == pytest.approx(1 - 400 ** (1 / 90), rel=1e-12)
    assert published == pytest.approx(-0.069, abs=5e-4)
    assert published < 0
    assert (1 - published) ** K == pytest.approx(400.0, rel=1e-9)
    # the derived decay for the same ratio (floor / start = div / final_div = 1/400) decays
    gamma = derive_decay(1.0, div / final_div, K)
    assert 0 <= gamma < 1
    assert gamma == pytest.approx(1 - 400 ** (-1 / 90), rel=1e-12)  # ~ +0.0644
    assert (1 - gamma) ** K == pytest.approx(1 / 400, rel=1e-12)
    # and for OneCycle's full peak -> floor ratio 1 / (div * final_div)
    gamma_full = derive_decay(1.0, 1.0 / div / final_div, K)
    assert 0 <= gamma_full < 1
    assert (1 - gamma_full) ** K == pytest.approx(1 / (div * final_div), rel=1e-12)
