"""The simulated execution engine: real KV bookkeeping, virtual time, a known target.

`SimEngine` has what the scheduler uses of `ExecutionEngine` (runners with a paged KV cache,
prefix caches, the tokenizer's EOS, the model length, the clock). Its runners keep the real
`KVCache` and block allocator (one layer, one head of width one: the bookkeeping, not the
bytes), so admission, preemption and prefix matching behave exactly as on a real engine.

A forward advances the virtual clock by the cost model's time for the batch and returns
logits whose greedy choice at (token t, position p) is `true_next(t, p)`: a fixed hash, the
simulated target's "language". A drafted child is accepted exactly when it carries that
token, which is how the synthetic drafter controls acceptance.

The clock counts simulated forwards and draft steps; with `host_time` it also counts the
host time the scheduler itself spends (this machine's, so only for simulating this machine).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from adaserve.exec.batch import ForwardBatch
from adaserve.exec.kv_cache import KVCache
from adaserve.exec.model.llama import LlamaArgs
from adaserve.exec.prefix_cache import PrefixCache
from adaserve.exec.runner import ForwardOutput, PlanToRun, run_plan
from adaserve.exec.timing import NUM_SEQS, TREE_TOKENS, split_tokens, tree_pairs_of
from adaserve.sim.cost import CostModel, ForwardNoise

# Token ids of the simulated target: small, so logits rows are cheap.
SIM_VOCAB = 128
SMALL_COUNTS = (1, 2, 3, 4, 6, 8, 12)


class VirtualClock:
    """Seconds since the start of the simulation (callable, like time.monotonic)."""

    def __init__(self, host_time: bool = False) -> None:
        self.t = 0.0
        self.host_time = host_time
        self._last = time.perf_counter()

    def __call__(self) -> float:
        if self.host_time:
            now = time.perf_counter()
            self.t += now - self._last
            self._last = now
        return self.t

    def advance(self, seconds: float) -> None:
        self()
        self.t += seconds
        self._last = time.perf_counter()  # the simulation's own work is not the server's

    def jump_to(self, t: float) -> None:
        """Idle until `t` (no request is running)."""
        self()
        self.t = max(self.t, t)
        self._last = time.perf_counter()


class _Tokenizer:
    """The scheduler only asks for EOS (simulated requests ignore it) and stop-string text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class SimRunner:
    """A runner whose forward costs virtual time; `target` set: it returns target logits.

    Implements `exec/runner.py`'s Runner: one layer, one head of width one, `SIM_VOCAB`
    tokens; no features (an EAGLE head is not simulated)."""

    needs_context = False
    attention_tile_tokens: int | None = None  # the simulated cost has no step at a size
    capture_hidden = False
    last_hidden: torch.Tensor | None = None
    checkpoint: Path | None = None
    head_token_ids = None

    def __init__(
        self,
        cost: CostModel,
        num_blocks: int,
        block_size: int,
        clock: VirtualClock,
        noise: ForwardNoise | None = None,
        rng: random.Random | None = None,
        target: bool = True,
    ) -> None:
        self.cost, self.clock, self.noise = cost, clock, noise
        # A padded forward costs the padded size's time; llama.cpp's forwards are never padded.
        self.supports_padding = cost.backend != "ggml"
        self.rng = rng or random.Random(0)
        self.target = target
        self.cache = KVCache(1, num_blocks, block_size, 1, 1, torch.float32, torch.device("cpu"))
        self.device = self.cache.device
        self.num_forwards = 0
        self.busy_s = 0.0

    @property
    def args(self) -> LlamaArgs:
        return LlamaArgs(
            architecture="LlamaForCausalLM",
            vocab_size=SIM_VOCAB,
            hidden_size=1,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=1,
            rms_norm_eps=1e-6,
            max_position_embeddings=1 << 20,
            rope_theta=10000.0,
            rope_scaling=None,
            qkv_bias=False,
            tie_word_embeddings=True,
            sliding_window=None,
        )

    def charge(self, tokens: int, context: int, num_seqs: int) -> float:
        """Advance the clock by one forward of this shape (draft steps); returns its seconds."""
        q = tokens / max(1, num_seqs)
        return self._spend(tokens, context, int(tokens * (context / max(1, num_seqs) + q)))

    def _spend(
        self,
        tokens: int,
        context: int,
        pairs: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> float:
        s = self.cost.seconds(tokens, context, pairs, silent, silent_pairs, tree_pairs)
        if self.noise is not None:
            s *= self.noise.factor(self.rng)
        self.clock.advance(s)
        self.num_forwards += 1
        self.busy_s += s
        return s

    def forward(self, batch: ForwardBatch, pad_to: int | None = None) -> torch.Tensor | None:
        n = len(batch.token_ids)
        context = sum(kv - q for kv, q in zip(batch.kv_lens, batch.query_lens))
        pairs = sum(q * kv for kv, q in zip(batch.kv_lens, batch.query_lens))
        rows = range(n) if batch.logits_indices is None else batch.logits_indices
        padded = max(n, pad_to or 0)
        silent, silent_pairs, tree_pairs = batch.cost_terms()
        # context as the real scheduler counts it: every sequence's cached tokens, once.
        self._spend(padded, context, pairs, silent + padded - n, silent_pairs, tree_pairs)
        if not self.target or not rows:
            return None
        ids, pos = batch.token_ids, batch.positions
        logits = torch.zeros(len(rows), SIM_VOCAB)
        right = [true_next(ids[i], pos[i]) for i in rows]
        logits[torch.arange(len(rows)), torch.tensor(right)] = 1.0
        return logits

    def cost_points(self, max_tokens: int) -> list[tuple[int, int, float]]:
        """The cost curve a real runner would measure at start-up (no noise: a quiet machine)."""
        counts = sorted({n for n in SMALL_COUNTS if n <= max_tokens} | _powers(max_tokens))
        points = []
        for n in counts:
            seqs = min(n, NUM_SEQS)
            points.append((n, 64 * seqs, self.cost.curve(n, 64, NUM_SEQS)))
        return points

    def timing_key(self) -> tuple | None:
        return None  # its cost is a model's, computed: nothing to measure once

    def tree_pair_cost(self) -> float | None:
        """What `timing.tree_pair_cost` would measure on this cost model: the curve's tokens
        spread over NUM_SEQS sequences of 64 against the same tokens on one sequence."""
        spread = split_tokens(TREE_TOKENS, NUM_SEQS)
        total = 64 * len(spread)
        shapes = []
        for lens, context in ((spread, 64), ([TREE_TOKENS], total)):
            pairs = sum(context + j + 1 for q in lens for j in range(q))
            tree = tree_pairs_of(lens, context)
            shapes.append((self.cost.seconds(TREE_TOKENS, total, pairs, tree_pairs=tree), tree))
        (curve_s, curve_t), (tree_s, tree_t) = shapes
        return max((tree_s - curve_s) / (tree_t - curve_t), 0.0)


def _powers(limit: int) -> set[int]:
    out, n = set(), 1
    while n <= limit:
        out.add(n)
        n *= 2
    return out


def true_next(token: int, position: int) -> int:
    """The simulated target's greedy next token after `token` at `position`."""
    return (token * 1_000_003 + position * 7_919 + 12_345) % SIM_VOCAB


class SimEngine:
    """What the scheduler sees of an engine, simulated."""

    cuda_graphs = False
    draft_graphs = None
    draft_is_head = False  # a simulated draft is a draft model (it reads tokens only)

    def __init__(
        self,
        cost: CostModel,
        draft_cost: CostModel | None,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        prefix_caching: bool,
        clock: VirtualClock,
        noise: ForwardNoise | None = None,
        seed: int = 0,
    ) -> None:
        self.clock = clock
        rng = random.Random(seed + 1)
        self.target = SimRunner(cost, num_blocks, block_size, clock, noise, rng)
        self.draft: SimRunner | None = None
        if draft_cost is not None:
            self.draft = SimRunner(draft_cost, num_blocks, block_size, clock, noise, rng, False)
        self.tokenizer = _Tokenizer()
        self.generation_eos_ids: tuple[int, ...] = ()
        self.max_model_len = max_model_len
        self.vocab_size = SIM_VOCAB
        self.target_prefix = PrefixCache(self.target.cache) if prefix_caching else None
        self.draft_prefix = (
            PrefixCache(self.draft.cache) if prefix_caching and self.draft is not None else None
        )

    def enable_draft_graphs(self, max_num_seqs: int, max_width: int) -> None:
        return None

    def run(self, plan: PlanToRun) -> ForwardOutput:
        """Run one iteration's plan on the virtual clock, as `ExecutionEngine.run` does."""
        return run_plan(self.target, self.draft, plan, self.clock)

    true_next = staticmethod(true_next)

    @staticmethod
    def wrong_token(right: int, j: int) -> int:
        """A token other than `right` (the j-th wrong guess)."""
        return (right + 1 + j) % SIM_VOCAB
