"""Request validation, SLO classes, metric registries and CLI flags, without a server."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from adaserve.api.metrics import FinishedRequest, ServerMetrics, slo_class_of
from adaserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    describe_validation_error,
)
from adaserve.args import engine_configs
from adaserve.cli import build_parser
from adaserve.config import parse_slo_classes

BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "slo_tpot_ms": 0}, "slo_tpot_ms"),
    ({"prompt": "hi", "slo_tpot_ms": -3}, "slo_tpot_ms"),
    ({"prompt": "hi", "slo_tpot_ms": "fast"}, "slo_tpot_ms"),
    ({"prompt": "hi", "slo_tpot_ms": True}, "slo_tpot_ms"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_fields_are_named(body: dict, param: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    message, got_param = describe_validation_error(info.value)
    assert got_param == param, f"{body}: error names {got_param!r}, expected {param!r}"
    assert param.split(".")[-1] in message, f"message {message!r} does not name {param!r}"


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
    ],
)
def test_bad_chat_fields_are_named(body: dict, param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert describe_validation_error(info.value)[1] == param


def test_non_object_body_names_no_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(["hi"])
    message, param = describe_validation_error(info.value)
    assert param is None and "JSON object" in message, message


def test_fields_reach_sampling_params() -> None:
    body = CompletionRequest.model_validate(
        {
            "prompt": [[1, 2, 3]],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 0,
            "seed": 3,
            "stop": "x",
            "ignore_eos": True,
            "slo_tpot_ms": 40,
            "unknown": 1,
            "min_tokens": 2,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "min_p": 0.1,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
    )
    assert body.prompt == [1, 2, 3], "a batch of one token list is that prompt"
    p = body.to_sampling_params(default_slo_tpot_ms=None)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (5, 0.0, 0.5, -1, 3)
    assert p.stop == ("x",) and p.ignore_eos and p.slo_tpot_ms == 40
    assert (p.min_tokens, p.repetition_penalty, p.presence_penalty) == (2, 1.2, 0.5)
    assert (p.frequency_penalty, p.min_p) == (-0.5, 0.1)
    assert p.include_stop_str_in_output and not p.skip_special_tokens


def test_default_slo_applies_only_without_one() -> None:
    no_slo = CompletionRequest.model_validate({"prompt": "a"})
    assert no_slo.to_sampling_params(default_slo_tpot_ms=80.0).slo_tpot_ms == 80.0
    assert no_slo.to_sampling_params(default_slo_tpot_ms=None).slo_tpot_ms is None
    own = CompletionRequest.model_validate({"prompt": "a", "slo_tpot_ms": 30})
    assert own.to_sampling_params(default_slo_tpot_ms=80.0).slo_tpot_ms == 30


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_tokens": 9,
            "max_completion_tokens": 3,
        }
    )
    assert body.to_sampling_params(None).max_tokens == 3
    assert body.message_dicts() == [{"role": "user", "content": "a"}], "text parts are joined"


def test_slo_class_is_the_first_bound_at_or_above() -> None:
    classes = parse_slo_classes("urgent=50,normal=150,relaxed=inf")
    got = [slo_class_of(v, classes) for v in (None, 1.0, 50.0, 50.1, 150.0, 1e6)]
    assert got == ["none", "urgent", "urgent", "normal", "normal", "relaxed"], got
    assert slo_class_of(500.0, parse_slo_classes("a=10,b=100")) == "other"


def test_two_servers_metrics_do_not_collide() -> None:
    classes = parse_slo_classes("fast=50,slow=inf")
    a, b = ServerMetrics(classes), ServerMetrics(classes)  # would raise on a shared registry
    a.observe_finished(FinishedRequest("stop", 40.0, "fast", True, 3, 10, 0.1, 30.0, 0.5, 4, 2))
    assert b'adaserve_goodput_tokens_total{model_name="",slo_class="fast"} 10.0' in a.render()
    assert b'adaserve_goodput_tokens_total{model_name="",slo_class="fast"} 0.0' in b.render()


def test_violation_counts_no_goodput() -> None:
    m = ServerMetrics(parse_slo_classes("fast=50"))
    m.observe_finished(FinishedRequest("length", 40.0, "fast", False, 3, 10, 0.1, 90.0, 1.0, 0, 0))
    text = m.render().decode()
    assert 'adaserve_slo_violated_total{model_name="",slo_class="fast"} 1.0' in text
    assert 'adaserve_goodput_tokens_total{model_name="",slo_class="fast"} 0.0' in text


def test_a_late_first_token_is_a_violation_but_the_tpot_only_counter_keeps_it() -> None:
    m = ServerMetrics(parse_slo_classes("fast=50"))
    late = FinishedRequest(
        "length", 40.0, "fast", False, 3, 10, 9.0, 30.0, 9.5, 0, 0,
        ttft_attained=False, tpot_attained=True, ttft_objective_ms=2000.0,
    )  # fmt: skip
    m.observe_finished(late)
    text = m.render().decode()
    assert 'adaserve_slo_violated_total{model_name="",slo_class="fast"} 1.0' in text
    assert 'adaserve_goodput_tokens_total{model_name="",slo_class="fast"} 0.0' in text
    assert 'adaserve_tpot_slo_attained_total{model_name="",slo_class="fast"} 1.0' in text
    assert 'adaserve_ttft_slo_violated_total{model_name="",slo_class="fast"} 1.0' in text


def test_serve_flags_reach_the_configs() -> None:
    a = build_parser().parse_args(
        [
            "serve",
            "/m",
            "--draft-model",
            "/d",
            "--policy",
            "sequence",
            "--budget",
            "32",
            "--max-num-seqs",
            "8",
            "--max-waiting",
            "4",
            "--num-blocks",
            "100",
            "--max-model-len",
            "256",
            "--dtype",
            "bfloat16",
            "--slo-classes",
            "a=10,b=inf",
            "--default-slo-tpot-ms",
            "75",
            "--api-key",
            "k",
            "--served-model-name",
            "x",
        ]
    )
    model, cache, sched = engine_configs(a, max_waiting=a.max_waiting)
    assert (model.model, model.draft_model, model.dtype, model.max_model_len) == (
        "/m",
        "/d",
        "bfloat16",
        256,
    )
    assert cache.num_blocks == 100
    assert (sched.policy, sched.budget, sched.max_num_seqs, sched.max_waiting) == (
        "sequence",
        32,
        8,
        4,
    )
    assert a.slo_classes == (("a", 10.0), ("b", math.inf)) and a.default_slo_tpot_ms == 75.0


def test_serve_defaults_to_the_adaserve_policy_on_the_default_model() -> None:
    a = build_parser().parse_args(["serve"])
    assert a.model is None and a.policy == "adaserve" and a.port == 8000


@pytest.mark.parametrize(
    "flag", [["--default-slo-tpot-ms", "0"], ["--slo-classes", "x"], ["--policy", "fastest"]]
)
def test_bad_serve_flags_exit_with_usage(flag: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flag])


def test_calibration_gauges_carry_only_depths_with_verified_nodes() -> None:
    from adaserve.request_manager.control.calibration import DepthCalibration

    m = ServerMetrics(parse_slo_classes("fast=50"))
    m.set_calibration(
        [DepthCalibration(1, 12.0, 0.8, 0.6, 0.5), DepthCalibration(2, 0.0, None, None, None)],
        drafting=True,
    )
    lines = [ln for ln in m.render().decode().splitlines() if ln.startswith("adaserve_calib")]
    observed = [ln for ln in lines if ln.startswith("adaserve_calibration_observed_acceptance")]
    assert len(observed) == 1 and 'depth="1"' in observed[0] and observed[0].endswith(" 0.5")
    assert not [ln for ln in lines if 'depth="2"' in ln], "a depth with no verified node has data"
    assert any(ln.endswith(" 0.8") for ln in lines if "draft_probability" in ln)
    assert any(ln.endswith(" 0.6") for ln in lines if "predicted_acceptance" in ln)
