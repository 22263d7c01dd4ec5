"""The drafters benchmark's `--configs` entries: a policy, a drafter and scheduler knobs set
per configuration, so a knob is measured against the default side by side in one run."""

from __future__ import annotations

import pytest

from adaserve.bench.drafters import parse_config


def test_an_entry_names_policy_drafter_and_typed_scheduler_fields():
    assert parse_config("incremental") == ("incremental", "", {})
    assert parse_config("adaserve:suffix") == ("adaserve", "suffix", {})
    policy, drafter, sets = parse_config(
        "adaserve:suffix,explore_budget=0.01,explore_observations=8,prompts_yield=false"
    )
    assert (policy, drafter) == ("adaserve", "suffix")
    assert sets == {"explore_budget": 0.01, "explore_observations": 8, "prompts_yield": False}
    assert type(sets["explore_observations"]) is int


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("adaserve:suffix,explore_budge=0.01", "'explore_budge=0.01' is not field=value"),
        ("adaserve:suffix,explore_budget", "'explore_budget' is not field=value"),
        ("adaserve,explore_observations=1.5", "explore_observations takes int values, not '1.5'"),
        ("adaserve,prompts_yield=1", "prompts_yield takes bool values, not '1'"),
    ],
)
def test_a_bad_entry_says_what_to_fix(entry: str, message: str):
    with pytest.raises(ValueError, match="--configs") as err:
        parse_config(entry)
    assert message in str(err.value), str(err.value)
