"""AcceptanceCalibrator: learns a miscalibrated draft, stays monotone, counts only real trials."""

from __future__ import annotations

import math
import random

import pytest

from adaserve.request_manager.control.calibration import AcceptanceCalibrator
from adaserve.tree.candidate import CandidateTree


def feed(cal: AcceptanceCalibrator, rng: random.Random, n: int, factor: float, depth: int = 1):
    """n trials at `depth` with q uniform on [0, 1] and true acceptance factor * q."""
    for _ in range(n):
        q = rng.random()
        cal.observe(depth, q, rng.random() < factor * q)


def test_learns_a_draft_that_is_twice_too_confident():
    cal = AcceptanceCalibrator(decay=1.0)
    feed(cal, random.Random(0), 8000, factor=0.5, depth=2)
    for q in (0.15, 0.3, 0.5, 0.7, 0.85):
        got = cal.calibrated(2, q)
        assert abs(got - 0.5 * q) < 0.05, f"calibrated(2, {q}) = {got:.3f}, true {0.5 * q:.3f}"
    # Other depths never saw data: they still trust the draft.
    assert abs(cal.calibrated(1, 0.5) - 0.5) < 0.05, "depth 1 moved without observations"


def test_learns_with_default_forgetting():
    # decay 0.995 keeps ~400 effective trials per bin, so single bins are noisier (std ~0.03).
    cal = AcceptanceCalibrator()
    feed(cal, random.Random(1), 5000, factor=0.5)
    errors = [abs(cal.calibrated(1, q) - 0.5 * q) for q in (0.05 + 0.1 * b for b in range(10))]
    assert sum(errors) / len(errors) < 0.04, f"decay 0.995: mean error {sum(errors) / 10:.3f}"
    assert max(errors) < 0.1, f"decay 0.995: worst bucket error {max(errors):.3f}"


def test_cold_start_is_the_prior():
    resolution = 0.1  # one bucket
    for scale in (1.0, 0.5):
        cal = AcceptanceCalibrator(prior_scale=scale)
        for q in (0.001, 0.02, 0.3, 0.66, 0.97, 1.0):
            got = cal.calibrated(3, q)
            assert abs(got - scale * q) <= scale * resolution / 2 + 1e-9, (
                f"cold start prior_scale={scale}: calibrated(3, {q}) = {got}, want ~{scale * q}"
            )
    # Small q stays proportional (path log-probs add): no flattening to the bucket centre.
    cal = AcceptanceCalibrator()
    assert cal.calibrated(1, 0.001) == pytest.approx(0.001), "tiny q inflated at cold start"
    assert cal.calibrated(1, 0.0) == pytest.approx(1e-4), "q = 0 not clamped to 1e-4"
    assert cal.calibrated(20, 0.5) == cal.calibrated(8, 0.5), "depth > max_depth not clamped"


def test_monotone_in_q_even_with_noisy_inverted_data():
    cal = AcceptanceCalibrator(decay=1.0)
    rng = random.Random(2)
    # A perverse draft: acceptance falls as q rises.
    for _ in range(800):
        q = rng.random()
        cal.observe(1, q, rng.random() < 1.0 - q)
    feed(cal, rng, 300, factor=0.7, depth=1)
    grid = [i / 1000 for i in range(1001)]
    values = [cal.calibrated(1, q) for q in grid]
    for q, a, b in zip(grid[1:], values, values[1:]):
        assert b >= a - 1e-12, f"calibrated not monotone at q={q}: {a} -> {b}"
    assert all(1e-4 <= v <= 1 - 1e-4 for v in values), "calibrated outside [1e-4, 1 - 1e-4]"


def small_tree() -> CandidateTree:
    """root 0 -> 1 (q .8) -> 3 (q .5) -> 5 (q .4); root -> 2 (q .1) -> 4 (q .9)."""
    tree = CandidateTree.root(7)
    tree.add_nodes(
        [0, 0, 1, 2, 3], [10, 11, 12, 13, 14], [math.log(p) for p in (0.8, 0.1, 0.5, 0.9, 0.4)]
    )
    return tree


def test_observe_verification_counts_only_children_of_accepted_nodes():
    cal = AcceptanceCalibrator(decay=1.0)
    tree = small_tree()
    # Verified everything; the target accepted 1 and rejected 3.
    cal.observe_verification(tree, verified_nodes=[0, 1, 2, 3, 4, 5], accepted_nodes=[1])
    summary = {d.depth: d for d in cal.depth_summary()}
    # Trials: 1 (accepted), 2 (rejected) at depth 1; 3 (rejected) at depth 2.
    # Node 4's parent 2 and node 5's parent 3 were rejected: no information.
    assert summary[1].observations == pytest.approx(2), "depth-1 trials miscounted"
    assert summary[1].acceptance_rate == pytest.approx(0.5), "depth-1 acceptance miscounted"
    assert summary[1].mean_draft_prob == pytest.approx(0.45), "depth-1 mean draft q wrong"
    assert summary[2].observations == pytest.approx(1), "node 4 (parent rejected) was counted"
    assert summary[2].acceptance_rate == pytest.approx(0.0), "depth-2 acceptance miscounted"
    assert summary[2].mean_draft_prob == pytest.approx(0.5), "depth-2 q is not the raw draft q"
    assert summary[3].observations == 0 and summary[3].acceptance_rate is None, (
        "node 5 (parent rejected) was counted"
    )
    assert summary[1].mean_calibrated_prob is not None, "no calibrated mean with observations"


def test_observe_verification_unverified_nodes_are_not_trials():
    cal = AcceptanceCalibrator(decay=1.0)
    cal.observe_verification(small_tree(), verified_nodes=[0, 1, 3], accepted_nodes=[1, 3])
    summary = cal.depth_summary()
    assert [d.observations for d in summary[:3]] == [1, 1, 0], "verified-node accounting wrong"
    assert summary[1].acceptance_rate == 1.0, "accepted depth-2 node not counted as accepted"


def test_calibrate_tree_sums_paths_and_leaves_the_input_alone():
    cal = AcceptanceCalibrator(decay=1.0)
    feed(cal, random.Random(3), 2000, factor=0.5, depth=1)
    tree = small_tree()
    before = (list(tree.logprobs), list(tree.path_logprobs), list(tree.tokens))
    out = cal.calibrate_tree(tree)
    assert (tree.logprobs, tree.path_logprobs, tree.tokens) == before, "input tree was modified"
    assert out.tokens == tree.tokens and out.parents == tree.parents, "structure changed"
    assert out.depths == tree.depths, "depths changed"
    assert out.logprobs[0] == 0.0 and out.path_logprobs[0] == 0.0, "root is not f = 1"
    for v in range(1, len(tree)):
        want = math.log(cal.calibrated(tree.depths[v], math.exp(tree.logprobs[v])))
        assert out.logprobs[v] == pytest.approx(want), f"node {v} logprob not calibrated"
        assert out.path_logprobs[v] == pytest.approx(
            out.path_logprobs[tree.parents[v]] + out.logprobs[v]
        ), f"node {v} path_logprob is not the sum of calibrated logprobs"
    assert out.logprobs[1] < tree.logprobs[1] - 0.3, "calibration did not lower an overconfident q"


def test_depths_without_observations_follow_the_depth_above():
    """A draft that depth 1 showed overconfident is not trusted at depths never observed (a
    suffix drafter's chains say q = 1 at every depth), and a depth's own data still rules."""
    cal = AcceptanceCalibrator(decay=1.0)
    rng = random.Random(5)
    for _ in range(200):
        cal.observe(1, 0.95, rng.random() < 0.3)
    for depth in (2, 5, 8):
        got = cal.calibrated(depth, 0.95)
        assert got < 0.45, f"depth {depth}, never observed, kept trusting q = 0.95: {got:.2f}"
    for _ in range(400):
        cal.observe(5, 0.95, rng.random() < 0.9)
    got = cal.calibrated(5, 0.95)
    assert abs(got - 0.9) < 0.06, f"depth 5's own 90% acceptance was overruled: {got:.2f}"
    assert cal.calibrated(6, 0.95) > 0.6, "depth 6 did not follow depth 5's evidence"


def test_forgetting_follows_a_change_in_the_target():
    cal = AcceptanceCalibrator()  # decay 0.995
    rng = random.Random(4)
    feed(cal, rng, 3000, factor=0.2)
    early = cal.calibrated(1, 0.75)
    assert abs(early - 0.15) < 0.06, f"did not learn the first regime: {early:.3f} vs 0.15"
    feed(cal, rng, 6000, factor=0.9)
    late = cal.calibrated(1, 0.75)
    assert abs(late - 0.675) < 0.08, f"did not follow the change: {late:.3f} vs 0.675"


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="decay"):
        AcceptanceCalibrator(decay=0.0)
    with pytest.raises(ValueError, match="depth"):
        AcceptanceCalibrator().calibrated(0, 0.5)
