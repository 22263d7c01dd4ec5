"""Per-request isolation: a fault in one request's own work (verification walk, first-token
sampling, output commit, detokenizing) fails that request alone; a drafter fault fails none.
Every other request finishes with exactly the output of a fault-free run, and no KV leaks."""

from __future__ import annotations

import logging

import pytest

from adaserve import SamplingParams
from adaserve.request_manager.output import OutputProcessor
from tests.request_manager.test_speculative import assert_no_blocks_held, make_engine, run

BAD = 77  # the faulty request's prompt starts with this token
PROMPTS = [[5, 6, 7, 8], [BAD, 9, 10], [11] * 20, [12, 13, 14], [40, 41, 42]]
PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * len(PROMPTS)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.conftest import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("iso")
    return make_tiny_checkpoint(d / "t", seed=0), make_tiny_checkpoint(d / "d", seed=1)


def is_bad(req) -> bool:
    return req.prompt_token_ids[0] == BAD


def run_all(engine):
    """(outputs by prompt, the bad request's output) running PROMPTS to the end."""
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(PROMPTS, PARAMS)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


STAGES = ["walk", "first_token", "commit", "detokenize"]
CASES = [(s, p) for p in ("incremental", "adaserve_paper") for s in STAGES]


@pytest.mark.parametrize("stage, policy", CASES + [("drafter", "adaserve_paper")])
def test_a_fault_in_one_request_fails_it_alone(pair, monkeypatch, caplog, stage, policy):
    target, draft = pair
    draft = None if policy == "incremental" else draft
    ref = run_all(make_engine(target, draft, policy))
    engine = make_engine(target, draft, policy)
    sched = engine.scheduler
    Scheduler = type(sched)
    if stage == "walk":  # the acceptance walk + KV keep of one request's verified tree
        real_tree = Scheduler._commit_tree

        def commit_tree(self, item, *args):  # item: the request's TreeItem in the plan
            r = item.request
            if is_bad(r) and len(r.output_token_ids) >= 3:
                raise RuntimeError("injected fault in the verification walk")
            return real_tree(self, item, *args)

        monkeypatch.setattr(Scheduler, "_commit_tree", commit_tree)
    elif stage == "first_token":  # the end of a prefill: its first token is sampled
        real_chunk = Scheduler._commit_chunk

        def commit_chunk(self, chunk, *args):  # chunk: the request's ChunkItem in the plan
            if is_bad(chunk.request):
                raise FloatingPointError("injected NaN in the prompt's last logits")
            return real_chunk(self, chunk, *args)

        monkeypatch.setattr(Scheduler, "_commit_chunk", commit_chunk)
    elif stage == "commit":
        real_commit = OutputProcessor.commit

        def commit(self, req, tokens, now):
            if is_bad(req) and len(req.output_token_ids) >= 4:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real_commit(self, req, tokens, now)

        monkeypatch.setattr(OutputProcessor, "commit", commit)
    elif stage == "detokenize":
        real_make = OutputProcessor.make_output

        def make_output(self, req):
            if is_bad(req) and len(req.output_token_ids) >= 5:
                raise ValueError("injected detokenizer fault")
            return real_make(self, req)

        monkeypatch.setattr(OutputProcessor, "make_output", make_output)
    elif stage == "drafter":
        assert sched.drafter is not None
        real_propose = sched.drafter.propose
        calls = {"n": 0}

        def propose(reqs, shape, keep_going=None):
            calls["n"] += 1
            if calls["n"] in (2, 5):
                raise RuntimeError("injected drafter fault")
            return real_propose(reqs, shape, keep_going)

        sched.drafter.propose = propose
    with caplog.at_level(logging.ERROR, logger="adaserve.speculation"):
        outs = run_all(engine)
    if stage == "drafter":
        # Counted, the traceback logged once: a drafter failing every iteration (a device
        # mismatch on a GPU did) must show in the count, not cost a traceback per iteration.
        assert engine.scheduler.planner.num_draft_failures == 2
        logged = [r for r in caplog.records if r.name == "adaserve.speculation"]
        assert [r.exc_info is not None for r in logged] == [True, False]
        assert "has failed in 2 iterations" in logged[1].getMessage()
    for out, want, prompt in zip(outs, ref, PROMPTS):
        if prompt[0] == BAD and stage != "drafter":
            assert out.outputs[0].finish_reason == "error", out.outputs[0]
            assert out.error is not None and "error id" in out.error, out.error
        else:
            assert out.outputs[0].token_ids == want.outputs[0].token_ids, (
                f"{stage}: request {prompt[:3]} changed"
            )
            assert out.outputs[0].finish_reason == "length"
    assert_no_blocks_held(engine)
    # The engine keeps serving afterwards.
    again, _ = run(engine, [[5, 6, 7, 8]], [PARAMS[0]])
    assert again[0] == ref[0].outputs[0].token_ids
