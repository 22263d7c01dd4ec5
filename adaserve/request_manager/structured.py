"""Structured output: a request's text held to a JSON schema, a regex, a grammar or a choice.

xgrammar compiles the constraint once per (constraint, tokenizer) into a token-level automaton;
each request walks its own matcher. Under speculation the constraint acts twice:

- before selection, every drafted node whose token the grammar refuses after its path is cut
  from the candidate tree with its subtree (`Grammar.valid_nodes`), so no verified token is
  spent on text the request could never emit;
- at verification, each tree node's logits are masked with the tokens the grammar allows after
  *that node's path* (`Grammar.mask_tree`), before any other processing. The walk then reads
  exactly the logits constrained plain decoding would read after committing that path: greedy
  output equals the constrained target's token for token, and sampling draws from the
  constrained distribution.

Both come from one traversal of the tree by xgrammar (`traverse_draft_tree`: node 0's row is
the state after the committed output, node v's row the state after root..v). A node the
grammar refuses, and any node past the grammar's end, gets a row that allows nothing; such a
row is never read by verification (the parent's mask already refuses the path into it), so
it is left unmasked rather than all -inf, which would turn a sampled row into NaNs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Kind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text.

    kind: "json_object" (any JSON object), "json_schema" (spec: the schema as JSON text),
    "regex" (spec: the pattern, matched in full), "grammar" (spec: EBNF with a `root` rule, as
    xgrammar and llama.cpp's GBNF write it) or "choice" (spec: a JSON list of the strings
    allowed). `any_whitespace`: JSON may put any whitespace between tokens (False: the
    compact `{"a": 1, "b": 2}` layout only)."""

    kind: Kind
    spec: str = ""
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError(
                    f"a choice is a non-empty list of non-empty strings, got {self.spec}"
                )

    @classmethod
    def json(cls, schema: dict[str, Any] | str | None = None) -> StructuredOutput:
        """Any JSON object (no schema), or one matching `schema` (a dict or JSON text)."""
        if schema is None:
            return cls("json_object")
        # Key order kept: xgrammar generates properties in the order the schema lists them.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


# xgrammar's messages start with a timestamp and its C++ source position.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer (thread-safe; xgrammar caches what it
    compiled, so a constraint compiled on the tokenizer thread is free on the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Collection[int]) -> None:
        """`vocab_size`: the model's (its logits' width); `stop_ids`: the tokens that end the
        output, the only ones the grammar allows once it is complete."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, so: StructuredOutput) -> Any:
        """The xgrammar CompiledGrammar; ValueError saying what is wrong with the constraint."""
        c = self._compiler
        try:
            if so.kind == "json_object":
                # strict_mode off: with no properties listed, strict would allow only {}.
                return c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=so.any_whitespace, strict_mode=False
                )
            if so.kind == "json_schema":
                return c.compile_json_schema(so.spec, any_whitespace=so.any_whitespace)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "grammar":
                return c.compile_grammar(so.spec)
            # A choice is a grammar of string literals: JSON's escapes are EBNF's.
            choices = json.loads(so.spec)
            return c.compile_grammar(
                "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)
            )
        except (RuntimeError, ValueError) as exc:
            message = _CPP_PREFIX.sub("", str(exc).strip()).strip()
            raise ValueError(f"invalid {so.kind.replace('_', ' ')}: {message}") from None

    def grammar(self, so: StructuredOutput, stop_ids: Collection[int] = ()) -> Grammar:
        """A fresh matcher for one request; `stop_ids` end it too (its stop_token_ids).
        ValueError when the constraint is invalid or no token of the vocabulary starts it."""
        g = Grammar(self.compile(so), self.vocab_size, self.stop_ids | set(stop_ids))
        if not g.tree_bitmask([0], [-1]).any():
            raise ValueError(
                f"no token of this model's vocabulary can start the {so.kind.replace('_', ' ')}"
            )
        return g


class Grammar:
    """One request's position in its constraint: advanced by every committed output token."""

    def __init__(self, compiled: Any, vocab_size: int, stop_ids: Collection[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))

    def accept(self, token: int) -> None:
        """Advance past a committed token; ValueError if the grammar refuses it (a bug: every
        emitted token was drawn from masked logits)."""
        if not self.matcher.accept_token(int(token)):
            raise ValueError(f"token {token} breaks the request's structured output")

    def tree_bitmask(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """[N, ceil(V / 32)] int32: per node of a tree (node 0 = the committed last token), the
        tokens the grammar allows after root..node; rows of refused nodes allow nothing."""
        n = len(tokens)
        first_child = [-1] * n
        next_sibling = [-1] * n
        last_child = [-1] * n
        for v in range(1, n):  # parents before children, children in index order
            p = parents[v]
            if first_child[p] < 0:
                first_child[p] = v
            else:
                next_sibling[last_child[p]] = v
            last_child[p] = v
        bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)  # [N, W] int32
        bitmask.zero_()  # nodes the traversal never reaches allow nothing
        self.matcher.traverse_draft_tree(
            torch.tensor(first_child, dtype=torch.int64),
            torch.tensor(next_sibling, dtype=torch.int64),
            torch.tensor([int(t) for t in tokens], dtype=torch.int64),
            bitmask,
        )
        return bitmask

    def valid_nodes(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Nodes whose whole path the grammar allows (root included), in index order."""
        bitmask = self.tree_bitmask(tokens, parents)
        valid = [True] * len(tokens)
        for v in range(1, len(tokens)):
            t, p = int(tokens[v]), parents[v]
            valid[v] = valid[p] and 0 <= t < self.vocab_size and _allows(bitmask, p, t)
        return [v for v in range(len(tokens)) if valid[v]]

    def mask_tree(
        self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]
    ) -> torch.Tensor:
        """[N, V] logits of a verify tree -> a float copy with each node's refused tokens at
        -inf (rows that allow nothing are left as they are; see the module's docstring)."""
        out = logits.float().clone()  # [N, V]
        bitmask = self.tree_bitmask(tokens, parents)
        if not bitmask[0].any():
            # The grammar needs text no token spells from here (xgrammar does not look ahead
            # past one token): the request cannot go on within its constraint.
            raise ValueError("no token of the vocabulary continues the structured output here")
        rows = [i for i in range(len(tokens)) if bool(bitmask[i].any())]
        if rows:
            self._xgr.apply_token_bitmask_inplace(
                out, bitmask.to(out.device), vocab_size=self.vocab_size, indices=rows
            )
        return out


def _allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
