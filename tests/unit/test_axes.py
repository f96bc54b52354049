"""Unit tests for hdet_scale.axes (fan-out multipliers, offsets, permutations)."""

from __future__ import annotations

import pytest
import torch

from hdet_scale.axes import draw_permutation, multipliers, replica_value, replica_values, spread_offsets

A = 1.0 / 9.0

HAND_OFFSETS = {
    1: [0.0],
    2: [-1.0, 1.0],
    3: [-1.0, 0.0, 1.0],
    4: [-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0],
    8: [-1.0, -5.0 / 7.0, -3.0 / 7.0, -1.0 / 7.0, 1.0 / 7.0, 3.0 / 7.0, 5.0 / 7.0, 1.0],
}


@pytest.mark.parametrize("R", sorted(HAND_OFFSETS))
def test_offsets_hand_values(R):
    got = spread_offsets(R)
    assert len(got) == R
    for g, want in zip(got, HAND_OFFSETS[R]):
        assert g == pytest.approx(want, abs=1e-15)
    if R > 1:  # the extremes are exactly -1 and +1
        assert (got[0], got[-1]) == (-1.0, 1.0)
    else:
        assert got == [0.0]


def test_multipliers_hand_values_small_R_exact():
    assert multipliers(1, A) == [1.0]
    assert multipliers(2, A) == [1.0 - A, 1.0 + A]
    assert multipliers(3, A) == [1.0 - A, 1.0, 1.0 + A]


@pytest.mark.parametrize("R", sorted(HAND_OFFSETS))
def test_multipliers_hand_values(R):
    got = multipliers(R, A)
    want = [1.0 + A * o for o in HAND_OFFSETS[R]]
    assert len(got) == R
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-15)
    if R == 4:
        assert got == pytest.approx([1 - A, 1 - A / 3, 1 + A / 3, 1 + A], abs=1e-15)
    # mean exactly 1 (float rounding only), inside [1 - a, 1 + a], increasing
    assert abs(sum(got) / R - 1.0) <= 1e-15
    assert all(1.0 - A <= m <= 1.0 + A for m in got)
    assert all(x < y for x, y in zip(got, got[1:]))


@pytest.mark.parametrize("R", [1, 2, 3, 4, 8])
def test_alpha_zero_gives_all_ones(R):
    assert multipliers(R, 0.0) == [1.0] * R
    assert replica_values(0.37, "multiplicative", 0.0, list(range(R))) == [0.37] * R
    assert replica_values(0.37, "additive", 0.0, list(range(R))) == [0.37] * R


@pytest.mark.parametrize("alpha", [1.0, 1.5, -1e-9, -0.5])
def test_bad_alpha_raises(alpha):
    with pytest.raises(ValueError):
        multipliers(4, alpha)


def test_alpha_just_below_one_keeps_multipliers_positive():
    m = multipliers(2, 0.999)
    assert min(m) > 0


def test_zero_replicas_raises():
    with pytest.raises(ValueError):
        spread_offsets(0)


def test_draw_permutation_is_seeded_permutation_and_leaves_global_rng():
    torch.manual_seed(12345)
    before = torch.random.get_rng_state().clone()
    g1 = torch.Generator().manual_seed(7)
    seq1 = [draw_permutation(g1, 8) for _ in range(20)]
    after = torch.random.get_rng_state()
    assert torch.equal(before, after)
    for p in seq1:
        assert sorted(p) == list(range(8))
        assert all(isinstance(i, int) for i in p)
    # same seed -> same sequence, whatever the global RNG does in between
    g2 = torch.Generator().manual_seed(7)
    seq2 = []
    for _ in range(20):
        torch.rand(17)
        seq2.append(draw_permutation(g2, 8))
    assert seq1 == seq2
    # different seed -> a different sequence; and the draws are not all the same permutation
    g3 = torch.Generator().manual_seed(8)
    assert [draw_permutation(g3, 8) for _ in range(20)] != seq1
    assert len({tuple(p) for p in seq1}) > 1
    # R = 1 -> [0]
    assert draw_permutation(torch.Generator().manual_seed(0), 1) == [0]


def test_replica_values_multiplicative_by_hand():
    base = 0.003
    perm = [2, 0, 3, 1]
    got = replica_values(base, "multiplicative", A, perm)
    off = HAND_OFFSETS[4]
    want = [base * (1 + A * off[perm[r]]) for r in range(4)]
    assert got == pytest.approx(want, rel=1e-15)
    assert got[1] == pytest.approx(base * (1 - A), rel=1e-15)  # slot 0: lowest
    assert got[2] == pytest.approx(base * (1 + A), rel=1e-15)  # slot 3: highest
    assert sum(got) / 4 == pytest.approx(base, rel=1e-15)
    # R = 2 exact
    assert replica_values(0.5, "multiplicative", A, [1, 0]) == [0.5 * (1 + A), 0.5 * (1 - A)]


def test_replica_values_additive_by_hand():
    base = 0.1
    alpha = 0.05
    perm = [1, 2, 0]
    got = replica_values(base, "additive", alpha, perm)
    # slots 1, 2, 0 -> offsets 0, +1, -1 -> base, base + alpha, base - alpha
    assert got == pytest.approx([0.1, 0.15, 0.05], abs=1e-16)
    assert sum(got) / 3 == pytest.approx(base, abs=1e-16)
    # additive spread does not scale with the base
    got0 = replica_values(0.0, "additive", alpha, perm)
    assert got0 == pytest.approx([0.0, 0.05, -0.05], abs=1e-17)
    assert replica_values(0.0, "multiplicative", alpha, perm) == [0.0, 0.0, 0.0]


def test_replica_value_single_slot():
    assert replica_value(2.0, "multiplicative", 0.25, 0, 2) == 1.5
    assert replica_value(2.0, "multiplicative", 0.25, 1, 2) == 2.5
    assert replica_value(2.0, "additive", 0.25, 0, 2) == 1.75
    assert replica_value(2.0, "additive", 0.25, 1, 2) == 2.25
