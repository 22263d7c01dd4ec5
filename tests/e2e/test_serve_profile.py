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
        expected = {"status": "ok", "policy": "adaserve", "budget": 6, "drafter": "model"}
        assert health == expected, health
    with serve_subprocess(
        *args, "--policy", "adaserve", "--profile", str(path), "--budget", "9"
    ) as url:
        assert httpx.get(f"{url}/health", timeout=10).json()["budget"] == 9, (
            "an explicit --budget must win over the profile"
        )
