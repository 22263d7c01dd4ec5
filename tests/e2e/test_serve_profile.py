"""`adaserve serve --profile FILE` takes B and t_spec from a measured profile."""

from __future__ import annotations

import httpx

from adaserve.request_manager.control.profile import LatencyPoint, Profile
from tests.e2e.harness import serve_subprocess


def test_serve_uses_the_budget_of_the_given_profile(tiny_llama, tmp_path):
    points = tuple(LatencyPoint(t, 64, 10.0 + t) for t in (1, 2, 4, 8))
    prof = Profile(
        device="cpu",
        model="tiny",
        draft_model="tiny",
        target=points,
        draft=points,
        budget=6,
        budget_factor=1.5,
        budget_context=64,
        baseline_latency_ms=11.0,
    )
    path = prof.save(tmp_path / "profile.json")
    args = (str(tiny_llama), "--draft-model", str(tiny_llama), "--num-blocks", "64")
    with serve_subprocess(*args, "--policy", "adaserve", "--profile", str(path)) as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        # The ceiling by the rule at 6x: every measured count (up to 8 tokens, 18 ms) is
        # within 6 x 11 ms, so the largest.
        expected = {
            "status": "ok",
            "policy": "adaserve",
            "budget": 6,
            "budget_ceiling": 8,
            "drafter": "model",
        }
        assert health == expected, health
    with serve_subprocess(
        *args, "--policy", "adaserve", "--profile", str(path), "--budget", "9"
    ) as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["budget"] == 9, "an explicit --budget must win over the profile"
        assert health["budget_ceiling"] == 9, "no profile applied: the ceiling is B"
    with serve_subprocess(
        *args, "--policy", "adaserve", "--profile", str(path), "--budget-ceiling", "7"
    ) as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert (health["budget"], health["budget_ceiling"]) == (6, 7), (
            "an explicit --budget-ceiling must win over the profile's"
        )


def test_serve_measures_no_cost_curve_that_its_profile_replaces(tiny_llama, tmp_path, monkeypatch):
    """`serve` with a profile builds its engine unprepared: the cost curve that would seed a
    cost model only to be replaced by the profile's is not timed (~7 s of a ggml start here);
    without a profile to apply (incremental, an explicit --budget) it is, once."""
    from adaserve import SamplingParams
    from adaserve.cli import build_engine, build_parser
    from adaserve.exec.timing import forget_measurements
    from adaserve.exec.torch_runner import ModelRunner

    forget_measurements()  # what this test counts is timed in this process, not recalled
    timed: list[tuple[ModelRunner, int]] = []  # (runner, max tokens) of each cost curve
    real = ModelRunner.cost_points
    monkeypatch.setattr(
        ModelRunner, "cost_points", lambda self, n: timed.append((self, n)) or real(self, n)
    )
    points = tuple(LatencyPoint(t, 64, 10.0 + t) for t in (1, 2, 4, 8))
    prof = Profile("cpu", "tiny", "tiny", points, points, 6, 1.5, 64, 11.0)
    path = prof.save(tmp_path / "profile.json")
    base = ["serve", str(tiny_llama), "--draft-model", str(tiny_llama), "--num-blocks", "64"]

    engine, _ = build_engine(build_parser().parse_args([*base, "--profile", str(path)]))
    # The draft's curve is timed once, at the profile's B; the target's not at all.
    assert timed == [(engine.engine.draft, 6)] and engine.sched_cfg.budget == 6
    assert engine.scheduler.cost.predict(4, 256) > 0, "the profile's cost model is in use"
    engine.add_request("a b c", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    last = []
    while engine.has_unfinished():
        last += [o for o in engine.step() if o.finished]
    # It serves: speculation may take several of the 4 tokens in one step, so count tokens.
    assert [(len(o.outputs[0].token_ids), o.error) for o in last] == [(4, None)], last
    for extra in (["--policy", "incremental"], ["--budget", "5"]):
        timed.clear()
        forget_measurements()  # as a fresh process would: nothing measured yet
        engine, _ = build_engine(build_parser().parse_args([*base, *extra]))
        target = [n for runner, n in timed if runner is engine.engine.target]
        assert target == [max(engine.sched_cfg.budget, 64)], extra
