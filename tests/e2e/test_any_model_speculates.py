"""`adaserve serve DIR` with any checkpoint and no draft model speculates (suffix drafter)."""

from __future__ import annotations

import json

import httpx

from tests import conftest
from tests.e2e.harness import metric, read_metrics, serve_subprocess


def test_serve_a_checkpoint_without_a_draft_speculates_with_the_suffix_drafter(
    tiny_llama, tmp_path
):
    log = tmp_path / "accept.jsonl"
    # Whether verifying a tree pays on this machine is speculation control's call, from
    # measured times: under load one tree forward that overran its prediction raises the price
    # of a tree token (`tree_cost_factor`) until exploring cannot pay, and nothing is verified
    # (seen with 2 busy processes beside the test: 0 tokens accepted, 1 run in 4). Control has
    # its own tests; here the paper's selection without it (`adaserve_paper`) verifies what
    # the suffix index proposes, so what is tested is the path from the index to accepted
    # tokens, not the machine's timing. The budget too: a start-up profile measured while
    # other tests load the machine gave B = 1, where the root fills it.
    steady = ["--policy", "adaserve_paper", "--budget", "16"]
    with serve_subprocess(str(tiny_llama), "--record-acceptance", str(log), *steady) as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["policy"] == "adaserve_paper" and health["drafter"] == "suffix", health
        body = {
            "model": str(tiny_llama),
            "prompt": "t5 t6 t7 t8",
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
        }
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        # The same prompt again: its answer is in the global cache of finished outputs.
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        m = read_metrics(url)
        accepted = metric(m, "adaserve_spec_decode_num_accepted_tokens_total")
        assert accepted >= 10, f"only {accepted} tokens accepted from a repeated answer"
        assert metric(m, "adaserve_drafter_info", policy="adaserve_paper", drafter="suffix") == 1
    # SIGTERM shut the server down cleanly (exit 0, checked by serve_subprocess) and it wrote
    # every verified tree for `adaserve simulate --acceptance` on the way out.
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(len(r["a"]) for r in rows) == accepted, "the log and the metrics disagree"
    # The start-up profile went to the tests' own cache, never to the user's.
    assert conftest.REAL_CACHE is not None
    assert not list((conftest.REAL_CACHE / "profiles").glob("tiny*")), "a test wrote a profile"


def test_serve_with_an_eagle_head_drafts_from_the_targets_features(tiny_llama, tmp_path):
    from adaserve import LLM, SamplingParams
    from tests.request_manager.test_eagle import write_head

    head = write_head(tiny_llama, tmp_path / "head")
    prompt = "t5 t6 t7 t8 t9"
    ref = LLM(model=str(tiny_llama), policy="incremental").generate(
        [prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    )[0]
    args = ("--draft-model", str(head), "--policy", "adaserve_paper")
    with serve_subprocess(str(tiny_llama), *args) as url:
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["drafter"] == "eagle", health
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        body["model"] = str(tiny_llama)
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert out["choices"][0]["text"] == ref.outputs[0].text, "EAGLE changed the output"
        m = read_metrics(url)
        assert metric(m, "adaserve_spec_decode_num_draft_tokens_total") > 0, "never drafted"
