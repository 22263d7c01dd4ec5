"""Suffix index: model-free candidate trees from earlier occurrences of a request's suffix.

The suffix drafter looks the request's last few committed tokens up in (a) the request's own
tokens and (b) a bounded cache of recently finished requests, and proposes what followed those
earlier occurrences. A lookup costs microseconds, not a draft-model forward.

Tree rule (`build_suffix_tree`):
    m_l, m_g = longest n-gram (min_match <= n <= max_ngram) ending the context that also occurs,
               with >= 1 token after it, in the local index / the global cache (0 if none)
    m        = max(m_l, m_g); occurrences O = those of every source whose match length is m,
               local (weight 1) before global (weight global_weight), most recent first,
               at most max_matches of them
    trie     = the continuations tokens[p : p + depth] of every occurrence in O
    W(v)     = sum of the weights of the occurrences whose continuation passes through v
               (W(root) = sum over O: every occurrence has >= 1 continuation token)
    P(v | parent(v)) = W(v) / (W(parent(v)) + a)          additive smoothing: one occurrence
               at a = 1 gives 1/2; occurrences ending early keep sum_children P < 1;
               a = alpha, or alpha x alpha_match_len / m when alpha_match_len > 0 (smoothing
               that shrinks as the match grows: a longer match is stronger evidence)
    f(v)     = prod of P along root..v; keep the max_nodes nodes of largest f(v)
               (ties: shallower, then larger W, then from the more recent occurrence). f never
               grows along a path, and a child ties its parent only at a greater depth, so the
               kept set is connected.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TypeVar

from adaserve.tree.candidate import CandidateTree

K = TypeVar("K")

# A posting: the end positions of one n-gram, increasing. Most n-grams of length >= 3 occur
# once, so one position is kept as a bare int and a list only from the second occurrence on.
# NOTE: a list per n-gram is a GC-tracked object; with torch loaded the collector's full passes
# over ~max_ngram new lists per token made indexing ~4x slower (9 vs 2 us per token).
Posting = int | list[int]


def _post(store: dict[K, Posting], key: K, p: int) -> None:
    posting = store.get(key)
    if posting is None:
        store[key] = p
    elif isinstance(posting, int):
        store[key] = [posting, p]
    else:
        posting.append(p)


def _recent_first(posting: Posting, end: int, limit: int | None) -> list[int]:
    """A posting's positions before `end` (the sequence length), newest first, at most limit."""
    positions = [posting] if isinstance(posting, int) else posting
    # Positions increase, so only the last one can be the (continuation-less) end.
    last = len(positions) - 1 if positions[-1] == end else len(positions)
    first = 0 if limit is None else max(0, last - limit)
    return positions[first:last][::-1]


def _tail(context: Sequence[int], max_ngram: int) -> tuple[int, ...]:
    return tuple(context[len(context) - min(max_ngram, len(context)) :])


def _check_min_len(min_len: int) -> None:
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")


def _check_max_ngram(max_ngram: int) -> None:
    if max_ngram < 1:
        raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")


class TokenIndex:
    """n-gram index (n = 1..max_ngram) over one growing token sequence: a request's own tokens."""

    def __init__(self, max_ngram: int = 8) -> None:
        _check_max_ngram(max_ngram)
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n-gram -> end positions p (exclusive: tokens[p-n:p] == ngram)
        self._ends: dict[tuple[int, ...], Posting] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing the (at most max_ngram) n-grams that end at each new one."""
        toks, ends, max_ngram = self.tokens, self._ends, self.max_ngram
        for token in tokens:
            toks.append(int(token))
            p = len(toks)
            window = tuple(toks[max(0, p - max_ngram) : p])
            for start in range(len(window)):
                _post(ends, window[start:], p)

    def longest_match(
        self, context: Sequence[int], min_len: int = 1, limit: int | None = None
    ) -> tuple[int, list[int]]:
        """Longest m in [min_len, max_ngram] with context[-m:] followed by >= 1 indexed token.

        Returns (m, end positions p, most recent first), at most `limit` of them; (0, []) if
        none. The occurrence ending at len(tokens) has no continuation and is left out.
        """
        _check_min_len(min_len)
        tail = _tail(context, self.max_ngram)
        for m in range(len(tail), min_len - 1, -1):
            posting = self._ends.get(tail[len(tail) - m :])
            if posting is not None:
                positions = _recent_first(posting, len(self.tokens), limit)
                if positions:
                    return m, positions
        return 0, []

    def continuation(self, p: int, depth: int) -> list[int]:
        """The (up to) `depth` tokens following end position p."""
        return self.tokens[p : p + depth]


class GlobalSuffixCache:
    """n-gram index over recently finished token sequences ("docs"), at most max_tokens in all.

    When the total exceeds max_tokens the least recently used docs (by `add` or `touch`) are
    evicted. A doc longer than max_tokens is truncated to its last max_tokens tokens: its tail
    is what the next, similar request is most likely to repeat.
    """

    def __init__(self, max_tokens: int, max_ngram: int = 8) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        _check_max_ngram(max_ngram)
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self._docs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self._last_used: dict[int, int] = {}  # doc id -> clock at its last add/touch
        self._clock = 0
        self._next_id = 0
        self._num_tokens = 0
        # n-gram -> doc id -> end positions in that doc. Keyed by doc so that an eviction
        # costs O(doc length * max_ngram), not a scan of every posting.
        self._ends: dict[tuple[int, ...], dict[int, Posting]] = {}

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_docs(self) -> int:
        return len(self._docs)

    @property
    def doc_ids(self) -> list[int]:
        """Held doc ids, least recently used (next to evict) first."""
        return list(self._docs)

    def doc_tokens(self, doc_id: int) -> list[int]:
        """The (possibly truncated) tokens held for a doc; KeyError if it was evicted."""
        return self._docs[doc_id]

    def add(self, tokens: Sequence[int]) -> int:
        """Index a finished sequence as the most recently used doc; returns its id."""
        doc = [int(t) for t in tokens[max(0, len(tokens) - self.max_tokens) :]]
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = doc
        self._tick(doc_id)
        self._num_tokens += len(doc)
        for key, p in self._ngrams(doc):
            by_doc = self._ends.get(key)
            if by_doc is None:
                self._ends[key] = by_doc = {}
            _post(by_doc, doc_id, p)
        while self._num_tokens > self.max_tokens:
            self._evict(next(iter(self._docs)))
        return doc_id

    def touch(self, doc_id: int) -> None:
        """Mark a doc as just used; a no-op for an evicted doc."""
        if doc_id in self._docs:
            self._docs.move_to_end(doc_id)
            self._tick(doc_id)

    def longest_match(
        self, context: Sequence[int], min_len: int = 1, limit: int | None = None
    ) -> tuple[int, list[tuple[int, int]]]:
        """As `TokenIndex.longest_match`, over all held docs: (m, [(doc_id, p), ...]).

        Matches come most recently used doc first, within a doc most recent position first.
        """
        _check_min_len(min_len)
        tail = _tail(context, self.max_ngram)
        for m in range(len(tail), min_len - 1, -1):
            by_doc = self._ends.get(tail[len(tail) - m :])
            if not by_doc:
                continue
            matches: list[tuple[int, int]] = []
            for doc_id in sorted(by_doc, key=self._last_used.__getitem__, reverse=True):
                left = None if limit is None else limit - len(matches)
                end = len(self._docs[doc_id])
                matches += ((doc_id, p) for p in _recent_first(by_doc[doc_id], end, left))
                if limit is not None and len(matches) >= limit:
                    break
            if matches:
                return m, matches
        return 0, []

    def continuation(self, doc_id: int, p: int, depth: int) -> list[int]:
        """The (up to) `depth` tokens following end position p of a held doc."""
        return self._docs[doc_id][p : p + depth]

    def _tick(self, doc_id: int) -> None:
        self._clock += 1
        self._last_used[doc_id] = self._clock

    def _ngrams(self, doc: list[int]) -> Iterator[tuple[tuple[int, ...], int]]:
        """(n-gram, end position) for every n-gram of the doc, in increasing end position."""
        for p in range(1, len(doc) + 1):
            window = tuple(doc[max(0, p - self.max_ngram) : p])
            for start in range(len(window)):
                yield window[start:], p

    def _evict(self, doc_id: int) -> None:
        doc = self._docs.pop(doc_id)
        del self._last_used[doc_id]
        self._num_tokens -= len(doc)
        for key in {key for key, _ in self._ngrams(doc)}:  # a repeated n-gram once
            by_doc = self._ends[key]
            del by_doc[doc_id]
            if not by_doc:
                del self._ends[key]


def build_suffix_tree(
    root_token: int,
    context: Sequence[int],
    local: TokenIndex | None,
    global_cache: GlobalSuffixCache | None,
    depth: int,
    max_nodes: int,
    min_match: int = 2,
    max_matches: int = 32,
    global_weight: float = 0.5,
    alpha: float = 1.0,
    alpha_match_len: int = 0,
) -> CandidateTree:
    """Candidate tree of what followed earlier occurrences of the context's suffix.

    context: the request's committed tokens (its last one is root_token). Returns the root
    alone when nothing matches, so no verification tokens are spent on an empty guess.
    """
    if alpha < 0 or global_weight <= 0:
        raise ValueError(f"need alpha >= 0 and global_weight > 0, got {alpha}, {global_weight}")
    tree = CandidateTree.root(root_token)
    if depth < 1 or max_nodes < 1 or max_matches < 1:
        return tree
    m_l, local_ends = (
        (0, []) if local is None else local.longest_match(context, min_match, max_matches)
    )
    m_g, global_ends = (
        (0, [])
        if global_cache is None
        else global_cache.longest_match(context, min_match, max_matches)
    )
    m = max(m_l, m_g)
    if m == 0:
        return tree

    # Continuations as (weight, tokens), local before global, at most max_matches in all.
    conts: list[tuple[float, list[int]]] = []
    if m_l == m:
        assert local is not None
        conts += [(1.0, local.continuation(p, depth)) for p in local_ends]
    if m_g == m:
        assert global_cache is not None
        used_docs: list[int] = []  # matches come grouped by doc
        for doc_id, p in global_ends[: max_matches - len(conts)]:
            conts.append((global_weight, global_cache.continuation(doc_id, p, depth)))
            if not used_docs or used_docs[-1] != doc_id:
                used_docs.append(doc_id)
        # Most recent last, so the used docs keep their relative order at the front of the LRU.
        for doc_id in reversed(used_docs):
            global_cache.touch(doc_id)

    # Trie of continuations; node 0 is the root.
    kids: list[dict[int, int]] = [{}]
    weight: list[float] = [0.0]
    token: list[int] = [int(root_token)]
    for w, cont in conts:  # each has >= 1 token: longest_match wants a continuation
        node = 0
        weight[0] += w
        for t in cont:
            child = kids[node].get(t)
            if child is None:
                child = len(token)
                kids[node][t] = child
                kids.append({})
                weight.append(0.0)
                token.append(t)
            weight[child] += w
            node = child

    smoothing = alpha * alpha_match_len / m if alpha_match_len > 0 else alpha

    # Best-first from the root: the heap pops nodes in descending f (ties: shallower, larger
    # W), which is the global top-max_nodes order since f never grows from parent to child.
    # (-log f, depth, -W, trie node, parent's tree node, logprob)
    heap: list[tuple[float, int, float, int, int, float]] = []

    def push_children(trie_node: int, tree_node: int, path_logprob: float, d: int) -> None:
        denom = weight[trie_node] + smoothing
        for child in kids[trie_node].values():
            logprob = math.log(min(1.0, weight[child] / denom))
            item = (-(path_logprob + logprob), d + 1, -weight[child], child, tree_node, logprob)
            heapq.heappush(heap, item)

    push_children(0, 0, 0.0, 0)
    parents: list[int] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    while heap and len(tokens) < max_nodes:
        neg_path, d, _, trie_node, parent, logprob = heapq.heappop(heap)
        parents.append(parent)
        tokens.append(token[trie_node])
        logprobs.append(logprob)
        push_children(trie_node, len(tokens), -neg_path, d)  # the trie is at most depth deep
    tree.add_nodes(parents, tokens, logprobs)
    return tree
