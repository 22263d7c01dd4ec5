"""Structured output (xgrammar) under speculation: drafted nodes the grammar refuses are never
verified, greedy output equals the constrained target's own (transformers with xgrammar's
logits processor), sampled output has the constrained distribution."""

from __future__ import annotations

import json
import math
from collections import Counter

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from adaserve import LLM, SamplingParams
from adaserve.request_manager.structured import GrammarCompiler, StructuredOutput
from adaserve.tree import CandidateTree
from tests.conftest import make_tiny_checkpoint
from tests.request_manager.test_speculative import assert_no_blocks_held, make_engine, run
from tests.stats import chi_square

# Word-level test tokenizer: tokens are "t0".."t95", t1 is EOS.
THREE = StructuredOutput.grammar('root ::= ("t2" | "t3") ("t3" | "t4" | "t5") ("t2" | "t5")')
# Any run of t5..t9, then t4 and the end; refuses most of what a random draft proposes. (No
# string here is a prefix of another token's: "t2" would pass as the start of "t20".)
RUN = StructuredOutput.grammar('root ::= ("t5" | "t6" | "t7" | "t8" | "t9")+ "t4"')
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
}


def constrained_reference(model_dir, prompts, so: StructuredOutput, max_tokens: int) -> list:
    """Greedy output of the target alone under the constraint: transformers' generate with
    xgrammar's own logits processor, one prompt at a time, stopping at EOS."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    out = []
    for p in prompts:
        ids = p if isinstance(p, list) else tok.encode(p)
        processor = xgr.contrib.hf.LogitsProcessor(compiler.compile(so))
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            logits_processor=[processor],
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


def accepts(compiler: GrammarCompiler, so: StructuredOutput, tokens: list[int]) -> bool:
    """Whether the grammar accepts these tokens in order (EOS included)."""
    m = xgr.GrammarMatcher(compiler.compile(so))
    return all(m.accept_token(t) for t in tokens)


def test_tree_masks_are_the_grammar_after_each_nodes_own_path(default_model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    compiler = GrammarCompiler(tok, 49152, [tok.eos_token_id])
    so = StructuredOutput.json(SCHEMA)
    grammar = compiler.grammar(so)
    committed = tok.encode('{"city": "Pa', add_special_tokens=False)
    for t in committed:
        grammar.accept(t)
    one = lambda s: tok.encode(s, add_special_tokens=False)[0]  # noqa: E731
    ris, quote, comma, newline, x = one("ris"), one('"'), one(","), one("\n"), one("x")
    # Inside the string "Pa...": "ris" goes on, a raw newline is refused (JSON escapes it);
    # after the closing quote a comma goes on, a letter is refused.
    tree = CandidateTree.root(committed[-1])
    a, b = tree.add_nodes([0, 0], [ris, newline], [-0.1, -0.2])
    (c,) = tree.add_nodes([a], [quote], [-0.1])
    d, e = tree.add_nodes([c, c], [comma, x], [-0.3, -0.3])
    (f,) = tree.add_nodes([b], [ris], [-0.5])  # below a refused node
    bitmask = grammar.tree_bitmask(tree.tokens, tree.parents)
    paths = {0: [], a: [ris], b: [newline], c: [ris, quote], d: [ris, quote, comma]}
    paths |= {e: [ris, quote, x], f: [newline, ris]}
    want_valid = []
    for v, path in sorted(paths.items()):
        fresh = compiler.grammar(so)
        if all(fresh.matcher.accept_token(t) for t in committed + path):
            want_valid.append(v)
            row = xgr.allocate_token_bitmask(1, 49152)
            fresh.matcher.fill_next_token_bitmask(row, 0)
            assert torch.equal(row[0], bitmask[v]), f"node {v}: its mask is not its path's"
    assert want_valid == grammar.valid_nodes(tree.tokens, tree.parents)
    assert want_valid == [0, a, c, d], f"the test tree should refuse b, e, f: {want_valid}"
    assert grammar.matcher.accept_token(ris), "walking the tree moved the request's position"


def test_refused_drafts_are_cut_with_their_subtrees(pair) -> None:
    engine = make_engine(pair["target"], pair["random"], "global_greedy")
    req = engine.add_request([5, 6], SamplingParams(max_tokens=4, structured_output=RUN))
    tree = CandidateTree.root(6)
    ok, bad = tree.add_nodes([0, 0], [7, 30], [-0.1, -0.1])
    under_ok = tree.add_nodes([ok, ok], [4, 31], [-0.1, -0.1])
    tree.add_nodes([bad, under_ok[0]], [5, 5], [-0.1, -0.1])  # below a refused node / the end
    cut = engine.scheduler.planner.constrain(req, tree)
    assert cut.tokens == [6, 7, 4] and cut.parents == [-1, 0, 1], (
        f"kept {cut.tokens} {cut.parents}: refused nodes or their subtrees survived"
    )


@pytest.mark.parametrize("policy", ["global_greedy", "adaserve_paper", "sequence"])
@pytest.mark.parametrize("draft", ["copy", "random"])
def test_greedy_constrained_output_equals_the_constrained_target(pair, policy, draft) -> None:
    prompts = [[5, 6, 7, 8], [9, 10], [11] * 20, [40, 41, 42]]
    max_tokens = 24
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=RUN)] * 4
    want = constrained_reference(pair["target"], prompts, RUN, max_tokens)
    engine = make_engine(pair["target"], pair[draft], policy)
    compiler = engine.grammars
    verified = 0
    engine_run = engine.engine.run

    def run_checked(plan):
        """Every node the engine is about to verify lies on a path the grammar allows."""
        nonlocal verified
        for item in plan.trees:
            vt = item.tree
            paths = [[]]
            for v in range(1, len(vt.tokens)):
                paths.append(paths[vt.parents[v]] + [vt.tokens[v]])
                assert accepts(compiler, RUN, item.request.output_token_ids + paths[v]), (
                    f"{policy}: verifies a node the grammar refuses: {paths[v]}"
                )
                verified += 1
        return engine_run(plan)

    planner = engine.scheduler.planner
    constrain, cut = planner.constrain, 0

    def constrain_counted(req, tree):
        nonlocal cut
        kept = constrain(req, tree)
        cut += len(tree) - len(kept)
        return kept

    engine.engine.run = run_checked
    planner.constrain = constrain_counted
    got, _ = run(engine, prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{policy}, {draft} draft, prompt {i}: {g} != constrained target {w}"
        assert accepts(compiler, RUN, g), f"prompt {i}: output {g} breaks the grammar"
    # Not vacuous: the target as draft gets nodes verified, the random draft gets nodes cut.
    if draft == "copy":
        assert verified > 0, "no drafted node was verified: the check above proved nothing"
    else:
        assert cut > 0, "the random draft never proposed a refused node"
    assert_no_blocks_held(engine)


def test_sampling_under_speculation_has_the_constrained_distribution(tmp_path) -> None:
    vocab, n = 6, 6000
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=vocab, seed=3)
    prompt = [2, 3, 4]
    # The target as its own draft: most drafts are accepted, many refused by the grammar.
    engine = make_engine(
        target, target, "global_greedy", num_blocks=2048, max_num_seqs=256, budget=512
    )
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, seed=i, structured_output=THREE)
        for i in range(n)
    ]
    outs, stats = run(engine, [prompt] * n, params)
    accepted = sum(s.accepted_tokens for s in stats)
    assert accepted > n // 4, f"only {accepted} draft tokens accepted: speculation barely ran"
    counts = Counter(tuple(o) for o in outs)
    # Exact constrained joint: each step's softmax over the tokens the grammar allows there.
    allowed = [(2, 3), (3, 4, 5), (2, 5)]
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def q(prefix: list[int], step: int) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1]
        keep = torch.tensor(allowed[step])
        p = logits[keep].softmax(-1)
        return {int(t): float(x) for t, x in zip(keep, p)}

    probs: dict[tuple[int, ...], float] = {}
    for a, pa in q([], 0).items():
        for b, pb in q([a], 1).items():
            for c, pc in q([a, b], 2).items():
                probs[(a, b, c)] = pa * pb * pc
    assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-5)
    assert set(counts) <= set(probs), f"outputs outside the grammar: {set(counts) - set(probs)}"
    stat, critical, df = chi_square(counts, probs, n)
    assert stat < critical, (
        f"constrained sampling is not the target's: chi2 {stat:.1f} >= {critical:.1f} (df {df})"
    )
    assert_no_blocks_held(engine)


def test_json_schema_on_the_default_model_equals_transformers_constrained(
    default_model_dir,
) -> None:
    prompts = [
        "Reply in JSON. The capital of France is Paris, population 2100000.",
        "Give me a JSON object describing Berlin.",
    ]
    so = StructuredOutput.json(SCHEMA)
    max_tokens = 48
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    want = constrained_reference(default_model_dir, [tok.encode(p) for p in prompts], so, 48)
    assert any(tok.eos_token_id in w for w in want), "no reference output completed its JSON"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=so)
    for kw in (dict(policy="incremental"), dict(policy="adaserve", drafter="suffix")):
        llm = LLM(backend="torch", **kw)
        got = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.token_ids == w, f"{kw}, prompt {i}: {g.text!r} != {tok.decode(w)!r}"
            if g.finish_reason == "stop":
                jsonschema.validate(json.loads(g.text), SCHEMA)


def test_json_on_ggml_is_the_same_with_and_without_speculation() -> None:
    from adaserve.exec.ggml import ggml_available

    if not ggml_available():
        pytest.skip("the ggml backend needs the `cpu` extra")
    prompts = ["List a city and its population as JSON.", "Describe a cat in JSON."]
    so = StructuredOutput.json(SCHEMA)
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_output=so)

    def texts(**kw) -> list:
        llm = LLM(backend="ggml", budget=16, **kw)
        assert llm.llm_engine.engine.backend == "ggml"
        return [llm.generate([p], params)[0].outputs[0] for p in prompts]

    want = texts(policy="incremental")
    for out in want:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    for kw in (dict(policy="adaserve", drafter="suffix"),):
        got = texts(**kw)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], f"{kw} differs"


def test_a_bad_constraint_or_combination_is_refused_with_its_reason(pair) -> None:
    engine = make_engine(pair["target"], None, "incremental")
    with pytest.raises(ValueError, match="invalid regex"):
        engine.add_request([5], SamplingParams(structured_output=StructuredOutput.regex("(t5")))
    with pytest.raises(ValueError, match="invalid json schema"):
        engine.check_structured_output(StructuredOutput.json({"type": "nonsense"}))
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured_output=RUN)
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_output=RUN)
    with pytest.raises(ValueError, match="choice is a non-empty list"):
        StructuredOutput("choice", "[]")
    assert not engine.has_unfinished(), "a refused request was queued"


def test_a_choice_ends_with_one_of_its_strings(pair) -> None:
    engine = make_engine(pair["target"], pair["copy"], "global_greedy")
    # The word tokenizer's tokens have no spaces: "t5t6" is tokens 5, 6.
    choice = StructuredOutput.choice(["t5t6", "t7"])
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=s, structured_output=choice)
        for s in range(16)
    ]
    outs, _ = run(engine, [[5, 6, 7]] * 16, params)
    assert all(o in ([5, 6, 1], [7, 1]) for o in outs), f"outside the choice: {outs}"
