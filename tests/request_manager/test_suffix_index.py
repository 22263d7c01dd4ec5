"""Suffix index and suffix-drafter trees against brute force: matches, counts, LRU, tree shape."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.request_manager.drafters.suffix_index import (
    GlobalSuffixCache,
    TokenIndex,
    build_suffix_tree,
)
from adaserve.tree.candidate import CandidateTree

# A 3-token alphabet so that random strings repeat their n-grams.
tokens_st = st.lists(st.integers(0, 2), max_size=30)
short_st = st.lists(st.integers(0, 2), max_size=10)
FAST = settings(max_examples=150, deadline=None)


def brute_ends(doc: Sequence[int], suffix: Sequence[int]) -> list[int]:
    """End positions p < len(doc) of suffix in doc, most recent first."""
    m = len(suffix)
    return [p for p in range(len(doc) - 1, m - 1, -1) if list(doc[p - m : p]) == list(suffix)]


def brute_local(tokens, context, min_len: int, max_ngram: int) -> tuple[int, list[int]]:
    for m in range(min(max_ngram, len(context)), min_len - 1, -1):
        ends = brute_ends(tokens, context[len(context) - m :])
        if ends:
            return m, ends
    return 0, []


def brute_global(docs_mru, context, min_len: int, max_ngram: int):
    """docs_mru: [(doc_id, tokens)], most recently used first."""
    for m in range(min(max_ngram, len(context)), min_len - 1, -1):
        suffix = context[len(context) - m :]
        found = [(d, p) for d, doc in docs_mru for p in brute_ends(doc, suffix)]
        if found:
            return m, found
    return 0, []


class LruModel:
    """The eviction rule, written plainly: the reference for GlobalSuffixCache's held docs."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.docs, self.next_id = max_tokens, OrderedDict(), 0

    def add(self, doc: list[int]) -> int:
        self.docs[self.next_id] = doc[max(0, len(doc) - self.max_tokens) :]
        self.next_id += 1
        while sum(map(len, self.docs.values())) > self.max_tokens:
            self.docs.popitem(last=False)
        return self.next_id - 1

    def touch(self, doc_id: int) -> None:
        if doc_id in self.docs:
            self.docs.move_to_end(doc_id)

    def mru(self) -> list[tuple[int, list[int]]]:
        return list(reversed(self.docs.items()))


def tree_paths(tree: CandidateTree) -> dict[tuple[int, ...], float]:
    """Token path (root excluded) -> P(node | parent), for every non-root node."""
    paths: list[tuple[int, ...]] = [()]
    out = {}
    for v in range(1, len(tree)):
        paths.append(paths[tree.parents[v]] + (tree.tokens[v],))
        out[paths[v]] = math.exp(tree.logprobs[v])
    return out


def reference_paths(
    context, local_tokens, model, depth, min_match, max_matches, gw, alpha, alpha_match_len=0
):
    """The tree rule by brute force, with no node limit: path -> W(path) / (W(parent) + a), a
    = alpha, or alpha x alpha_match_len / m after a match of m tokens."""
    m_l, ends_l = brute_local(local_tokens, context, min_match, 8) if local_tokens else (0, [])
    m_g, ends_g = brute_global(model.mru(), context, min_match, 8) if model else (0, [])
    m = max(m_l, m_g)
    conts = [(1.0, local_tokens[p : p + depth]) for p in ends_l] if m and m_l == m else []
    if m and m_g == m:
        conts += [(gw, model.docs[d][p : p + depth]) for d, p in ends_g]
    conts = conts[:max_matches]

    def weight(path: tuple[int, ...]) -> float:
        return sum(w for w, c in conts if len(c) >= len(path) and tuple(c[: len(path)]) == path)

    prefixes = {tuple(c[:k]) for _, c in conts for k in range(1, len(c) + 1)}
    a = alpha * alpha_match_len / m if alpha_match_len and m else alpha
    return {path: weight(path) / (weight(path[:-1]) + a) for path in prefixes}


@FAST
@given(st.lists(short_st, max_size=5), short_st, st.integers(1, 5), st.integers(1, 4))
def test_token_index_longest_match_is_brute_force(chunks, context, max_ngram, min_len) -> None:
    index = TokenIndex(max_ngram)
    for chunk in chunks:
        index.extend(chunk)
        for ctx in (context, index.tokens):
            want = brute_local(index.tokens, ctx, min_len, max_ngram)
            got = index.longest_match(ctx, min_len)
            assert got == want, f"tokens {index.tokens} context {ctx}: got {got}, want {want}"
            limited = index.longest_match(ctx, min_len, limit=2)
            assert limited == (want[0], want[1][:2]), f"limit=2 gave {limited} for {want}"
            for p in want[1]:
                assert index.continuation(p, 3) == index.tokens[p : p + 3], "bad continuation"
    assert len(index) == sum(map(len, chunks)), "len() is not the number of extended tokens"


ops_st = st.lists(
    st.one_of(st.tuples(st.just("add"), tokens_st), st.tuples(st.just("touch"), st.integers(0, 8))),
    max_size=12,
)


@FAST
@given(ops_st, st.integers(1, 40), st.lists(short_st, min_size=1, max_size=3), st.integers(1, 3))
def test_global_cache_is_lru_and_matches_brute_force(ops, max_tokens, contexts, min_len) -> None:
    cache, model = GlobalSuffixCache(max_tokens, max_ngram=4), LruModel(max_tokens)
    for op, arg in ops:
        if op == "add":
            assert cache.add(arg) == model.add(arg), "doc ids are not consecutive"
        else:
            cache.touch(arg)
            model.touch(arg)
        assert cache.num_tokens <= max_tokens, f"{cache.num_tokens} tokens held > {max_tokens}"
        assert cache.doc_ids == list(model.docs), (
            f"held docs (LRU first) {cache.doc_ids}, the LRU rule holds {list(model.docs)}"
        )
        assert cache.num_tokens == sum(map(len, model.docs.values())), "num_tokens is off"
        assert cache.num_docs == len(model.docs), "num_docs is off"
        for doc_id, doc in model.docs.items():
            assert cache.doc_tokens(doc_id) == doc, f"doc {doc_id} holds the wrong tokens"
        for ctx in contexts:
            want = brute_global(model.mru(), ctx, min_len, 4)
            got = cache.longest_match(ctx, min_len)
            assert got == want, f"docs {model.mru()} context {ctx}: got {got}, want {want}"
            assert all(d in model.docs for d, _ in got[1]), "an evicted doc was matched"
            assert cache.longest_match(ctx, min_len, limit=3) == (want[0], want[1][:3]), "limit"


def test_global_cache_touch_keeps_a_doc_and_truncates_long_docs() -> None:
    cache = GlobalSuffixCache(max_tokens=6)
    a, b = cache.add([1, 2, 3]), cache.add([4, 5, 6])
    cache.touch(a)
    c = cache.add([7, 8])
    assert cache.doc_ids == [a, c], f"touched doc {a} should outlive {b}; held {cache.doc_ids}"
    assert cache.longest_match([4, 5])[0] == 0, "the evicted doc's n-grams are still indexed"
    d = cache.add(list(range(10, 20)))
    assert cache.doc_ids == [d], f"a doc of max_tokens tokens evicts all others: {cache.doc_ids}"
    assert cache.doc_tokens(d) == list(range(14, 20)), "a long doc keeps its last max_tokens"
    assert cache.longest_match([14, 15]) == (2, [(d, 2)]), "the truncated doc is indexed"
    cache.touch(a)  # evicted: a no-op
    assert cache.doc_ids == [d], "touching an evicted doc brought it back"


@FAST
@given(tokens_st, st.integers(1, 6), st.integers(1, 3))
def test_tree_counts_are_brute_force_continuation_counts(tokens, depth, min_match) -> None:
    # alpha = 0, local only: P(v | parent) = count(v) / count(parent), so W is recoverable.
    index = TokenIndex()
    index.extend(tokens)
    root = tokens[-1] if tokens else 0
    tree = build_suffix_tree(
        root, tokens, index, None, depth, max_nodes=10_000, min_match=min_match,
        max_matches=10_000, alpha=0.0,
    )  # fmt: skip
    _, ends = brute_local(tokens, tokens, min_match, 8)
    counts = [float(len(ends))]
    paths: list[tuple[int, ...]] = [()]
    for v in range(1, len(tree)):
        counts.append(math.exp(tree.logprobs[v]) * counts[tree.parents[v]])
        paths.append(paths[tree.parents[v]] + (tree.tokens[v],))
        want = sum(tuple(tokens[p : p + len(paths[v])]) == paths[v] for p in ends)
        assert round(counts[v]) == want and math.isclose(counts[v], want), (
            f"path {paths[v]}: tree count {counts[v]}, brute-force count {want}"
        )
    want_nodes = {tuple(tokens[p : p + k]) for p in ends for k in range(1, depth + 1)}
    assert set(paths[1:]) == want_nodes, f"tree paths {paths[1:]} != continuations {want_nodes}"


@FAST
@given(
    tokens_st,
    st.lists(tokens_st, max_size=4),
    st.integers(0, 5),
    st.integers(0, 8),
    st.integers(1, 3),
    st.integers(1, 6),
    st.sampled_from([0.25, 0.5, 1.0]),
    st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    st.sampled_from([0, 1, 2]),
)
def test_tree_is_the_top_of_the_rule(
    tokens, docs, depth, max_nodes, min_match, mm, gw, alpha, alpha_match_len
):
    index, cache, model = TokenIndex(), GlobalSuffixCache(60), LruModel(60)
    index.extend(tokens)
    for doc in docs:
        cache.add(doc)
        model.add(doc)
    root = tokens[-1] if tokens else 0
    kw = dict(
        min_match=min_match, max_matches=mm, global_weight=gw, alpha=alpha,
        alpha_match_len=alpha_match_len,
    )  # fmt: skip
    want = reference_paths(tokens, tokens, model, depth, min_match, mm, gw, alpha, alpha_match_len)
    full = build_suffix_tree(root, tokens, index, cache, depth, 10_000, **kw)
    got = tree_paths(full)
    assert got.keys() == want.keys(), f"tree paths {sorted(got)} != rule's {sorted(want)}"
    for path, prob in want.items():
        assert math.isclose(got[path], prob), f"P{path} = {got[path]}, the rule gives {prob}"

    tree = build_suffix_tree(root, tokens, index, cache, depth, max_nodes, **kw)
    assert tree.tokens[0] == root and tree.parents[0] == -1, "node 0 is not the root"
    assert len(tree) - 1 <= max_nodes, f"{len(tree) - 1} nodes > max_nodes {max_nodes}"
    assert max(tree.depths) <= depth, f"depth {max(tree.depths)} > {depth}"
    if not want or max_nodes == 0:
        assert len(tree) == 1, "nothing to propose, yet the tree is not the root alone"
    else:
        assert len(tree) - 1 == min(max_nodes, len(want)), "the tree is smaller than it may be"
    for v in range(1, len(tree)):
        parent = tree.parents[v]
        assert 0 <= parent < v, f"node {v} has parent {parent}: not connected"
        prob = math.exp(tree.logprobs[v])
        # alpha = 0 gives P = 1 to an only child whose occurrences all go on
        assert 0.0 < prob < 1.0 or (alpha == 0 and prob == 1.0), f"P(node {v}) = {prob}"
    for kids in tree.children():
        toks = [tree.tokens[k] for k in kids]
        assert len(set(toks)) == len(toks), f"siblings repeat a token: {toks}"

    # The kept nodes are the max_nodes best of the full tree by (path prob, shallower).
    def keys(t: CandidateTree) -> list[tuple[float, int]]:
        return sorted((-t.path_logprobs[v], t.depths[v]) for v in range(1, len(t)))

    assert keys(tree) == keys(full)[:max_nodes], "kept nodes are not the top by path prob"


def test_hand_written_example() -> None:
    context = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    index = TokenIndex()
    index.extend(context)
    assert index.longest_match(context, 2) == (3, [7, 3]), "1,2,3 occurs ending at 7 and 3"
    tree = build_suffix_tree(3, context, index, None, depth=6, max_nodes=100, alpha=1.0)
    half, third = 1 / 2, 1 / 3
    want = {
        (4,): third, (5,): third,  # W = 1 each, W(root) = 2: 1 / (2 + 1)
        (4, 1): half, (4, 1, 2): half, (4, 1, 2, 3): half, (4, 1, 2, 3, 5): half,
        (4, 1, 2, 3, 5, 1): half,  # one occurrence: 1 / (1 + 1), cut at depth 6
        (5, 1): half, (5, 1, 2): half, (5, 1, 2, 3): half,  # the context ends here
    }  # fmt: skip
    assert tree_paths(tree) == pytest.approx(want, rel=1e-12), f"got {tree_paths(tree)}"
    assert tree.path_prob(len(tree) - 1) == pytest.approx(third * half**5), "path prob"
    small = build_suffix_tree(3, context, index, None, depth=6, max_nodes=3)
    assert set(tree_paths(small)) == {(4,), (5,), (5, 1)}, "best 3: both children, then ties"
    # alpha = 0: (4,) and (4, 1) both have f = 1/2; the shallower (5,) goes first.
    two = build_suffix_tree(3, context, index, None, depth=6, max_nodes=2, alpha=0.0)
    assert set(tree_paths(two)) == {(4,), (5,)}, f"ties go to the shallower: {tree_paths(two)}"


def test_a_longer_match_is_smoothed_less() -> None:
    # One earlier occurrence of each suffix; alpha = 1 applies as given at a 2-token match.
    kw = dict(depth=1, max_nodes=4, min_match=1, alpha=1.0, alpha_match_len=2)
    got = {}
    for context in ([7, 4, 9, 4], [7, 8, 4, 9, 8, 4], [7, 6, 8, 4, 9, 6, 8, 4]):
        index = TokenIndex()
        index.extend(context)
        m, _ = index.longest_match(context, 1)
        tree = build_suffix_tree(context[-1], context, index, None, **kw)
        assert tree.tokens[1:] == [9], f"after {context} the drafter proposed {tree.tokens[1:]}"
        got[m] = math.exp(tree.logprobs[1])
    # 1 / (1 + 2/m): a third after one token, a half after two (as alpha = 1 alone), 3/5 after 3
    assert got == pytest.approx({1: 1 / 3, 2: 1 / 2, 3: 3 / 5}), f"q by match length: {got}"


def test_local_and_global_tie_and_touch() -> None:
    local = TokenIndex()
    local.extend([1, 2, 3, 4, 1, 2, 3])
    cache = GlobalSuffixCache(100)
    used, other = cache.add([1, 2, 3, 5]), cache.add([8, 9])
    tree = build_suffix_tree(3, local.tokens, local, cache, depth=1, max_nodes=8)
    # Both match 1,2,3: W(4) = 1 (local), W(5) = 0.5 (global), W(root) = 1.5; alpha = 1.
    assert tree_paths(tree) == pytest.approx({(4,): 1 / 2.5, (5,): 0.5 / 2.5}), "tied sources"
    assert cache.doc_ids == [other, used], "the global doc that was used was not touched"
    longer = cache.add([4, 1, 2, 3, 6])  # matches 4 tokens: the local (3) is then ignored
    tree = build_suffix_tree(3, local.tokens, local, cache, depth=1, max_nodes=8)
    assert tree_paths(tree) == pytest.approx({(6,): 0.5 / 1.5}), "the longer match must win"
    assert cache.doc_ids[-1] == longer, "the used doc is the most recently used"
    nothing = build_suffix_tree(7, [9, 9, 7], local, cache, depth=4, max_nodes=8)
    assert len(nothing) == 1, "no match must give the root alone"


def test_touch_keeps_the_order_of_the_docs_used() -> None:
    cache = GlobalSuffixCache(100)
    first, second, unused = cache.add([1, 2, 5]), cache.add([1, 2, 6]), cache.add([9, 9])
    tree = build_suffix_tree(2, [1, 2], None, cache, depth=1, max_nodes=8)
    assert tree_paths(tree) == pytest.approx({(5,): 0.5 / 2, (6,): 0.5 / 2}), "two global docs"
    assert cache.doc_ids == [unused, first, second], f"LRU order after use: {cache.doc_ids}"


@pytest.mark.parametrize("suffix_max_depth, want", [(16, 16), (6, 6), (40, 24)])
def test_the_drafter_grows_a_copied_span_past_a_draft_models_depth(suffix_max_depth, want):
    """A lookup costs no draft step per level: on a request repeating a 40-token span, its
    chain runs to suffix_max_depth (bounded by the request's share of the tree), not to
    max_depth, which bounds a draft model's steps."""
    from adaserve.config import SchedulerConfig
    from adaserve.request_manager.drafters.suffix import SuffixDrafter
    from adaserve.request_manager.policies import spec_shape
    from adaserve.request_manager.request import Request, SamplingParams

    cfg = SchedulerConfig(policy="adaserve", budget=16, suffix_max_depth=suffix_max_depth)
    span = list(range(100, 140))
    req = Request("r", [7, 8, 9] + span + [5, 6] + span[:3], SamplingParams())
    shape = spec_shape(cfg, 1)
    assert shape is not None and shape.depth == cfg.max_depth == 6
    (tree,) = SuffixDrafter(cfg).propose([req], shape)
    assert max(tree.depths) == want  # the 24 other nodes of a 1-request tree bound the 40
    assert [tree.tokens[v] for v in range(1, want + 1)] == span[3 : 3 + want]
