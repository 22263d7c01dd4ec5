"""Stop handling options: min_tokens delays every stop condition, include_stop_str_in_output
keeps the matched string, skip_special_tokens=False keeps special tokens in the text."""

from __future__ import annotations

from adaserve import SamplingParams
from adaserve.request_manager.output import OutputProcessor
from adaserve.request_manager.request import Request
from tests.conftest import make_tokenizer


def finish(params: SamplingParams, tokens: list[int]) -> Request:
    """Commit `tokens` one at a time as decoding would; returns the request."""
    proc = OutputProcessor(make_tokenizer(96), max_model_len=512)
    req = Request("r", [5, 6], params)
    for t in tokens:
        if req.finished:
            break
        proc.commit(req, [t], 0.0)
        proc.make_output(req)
    req.text = proc.make_output(req).outputs[0].text  # the final text, as a client gets it
    return req


def test_min_tokens_ignores_eos_stop_ids_and_stop_strings_until_reached() -> None:
    eos, stop_id = 1, 9
    p = SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=(stop_id,), stop=("t7",))
    req = finish(p, [eos, stop_id, 7, 8, 7, 3])
    assert len(req.output_token_ids) == 5 and req.finish_reason == "stop", req.output_token_ids
    assert finish(SamplingParams(max_tokens=10, stop=("t7",)), [7]).output_token_ids == [7]


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    tokens = [4, 7, 8, 3]
    cut = finish(SamplingParams(max_tokens=10, stop=("t8",)), tokens)
    kept = finish(
        SamplingParams(max_tokens=10, stop=("t8",), include_stop_str_in_output=True), tokens
    )
    assert cut.text.rstrip() == "t4 t7" and kept.text.rstrip() == "t4 t7 t8", (cut.text, kept.text)


def test_skip_special_tokens_false_keeps_eos_in_the_text() -> None:
    tokens = [4, 1, 5]
    skipped = finish(SamplingParams(max_tokens=3, ignore_eos=True), tokens)
    kept = finish(SamplingParams(max_tokens=3, ignore_eos=True, skip_special_tokens=False), tokens)
    assert "t1" not in skipped.text and "t1" in kept.text, (skipped.text, kept.text)
