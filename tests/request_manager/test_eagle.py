"""The EAGLE drafter: features captured in verification, head KV across accept/reject,
lossless greedy output under every tree policy, the head checkpoint layout."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve import SamplingParams
from adaserve.config import POLICIES
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.loader import load_model
from adaserve.exec.model.eagle import (
    head_from_target,
    is_eagle_head,
    load_eagle_head,
    save_eagle_head,
)
from adaserve.request_manager.drafters.eagle import EagleDrafter
from tests.conftest import make_tiny_checkpoint
from tests.request_manager.test_speculative import assert_no_blocks_held, make_engine, run
from tests.virtual_time import slow_forwards

PROMPTS = [[5, 6, 7, 8], [9, 10], [11] * 20, [12, 13, 14], [40, 41, 42, 43, 44], [3]]
SLOS = [5.0, 50.0, None, 500.0, 5.0, None]


def write_head(target_dir, out_dir, seed: int = 0):
    """A head for `target_dir`: fc passes the feature through, a perturbed copy of the
    target's last layer (so it drafts something target-like and gets tokens accepted)."""
    target = load_model(target_dir)
    torch.manual_seed(seed)
    head = head_from_target(target)
    with torch.no_grad():
        for p in head.layers.parameters():
            p.mul_(0.5)
    return save_eagle_head(head, out_dir)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle")
    target = make_tiny_checkpoint(d / "target", seed=0)
    return target, write_head(target, d / "head")


class Recording(EagleDrafter):
    """Keeps every feature the target hands over and checks the head's cached rows: at each
    step 1, the root row's output from cached KV equals a forward of all rows from scratch."""

    def __init__(self, head) -> None:
        super().__init__(head)
        self.features: dict[str, dict[int, torch.Tensor]] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.checked = 0

    def observe_features(self, request, position, hidden):
        self.prompts[request.request_id] = tuple(request.prompt_token_ids)
        seen = self.features.setdefault(request.request_id, {})
        for i, row in enumerate(hidden):
            seen[position + i] = row.clone()
        super().observe_features(request, position, hidden)

    def propose(self, requests, shape, keep_going=None):
        trees = super().propose(requests, shape, keep_going)
        for r, tree in zip(requests, trees):
            st = self._state.get(r.request_id)
            if st is None or st.pos0 is None or len(tree) == 1:
                continue
            self._check_rows(r, st.pos0, tree)
        return trees

    def _check_rows(self, r, pos0: int, tree) -> None:
        feats = self.features[r.request_id]
        rows = list(range(pos0, r.num_tokens - 1))
        table: list[int] = []
        self.head.cache.reserve(table, len(rows))
        try:
            b = SequenceBatchBuilder()
            b.add([r.all_token_ids[p + 1] for p in rows], rows, len(rows), table, logits="last")
            b.batch.features = torch.stack([feats[p] for p in rows])
            logits = self.head.forward(b.batch)
        finally:
            self.head.cache.release(table)
        # The cached run's depth-1 children are the head's top tokens for the root row.
        first = [v for v in range(1, len(tree)) if tree.parents[v] == 0]
        best = self.head.model.head_token_ids
        top = int(logits[0].argmax())
        top = top if best is None else int(best[top])
        assert tree.tokens[first[0]] == top, "head KV rows differ from a fresh recomputation"
        self.checked += 1


def recording_engine(target, head, policy="adaserve_paper", **sched):
    e = make_engine(target, head, policy, drafter="eagle", **sched)
    rec = Recording(e.engine.draft)
    e.scheduler.planner.drafter = e.scheduler.drafter = rec
    return e, rec


def test_features_and_head_kv_stay_exact_across_accept_and_reject(pair):
    target, head = pair
    e, rec = recording_engine(*pair)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    outs, stats = run(e, PROMPTS, params)
    assert sum(s.accepted_tokens for s in stats) > 0, "nothing accepted: accept path not tested"
    assert any(s.tree_tokens > s.accepted_tokens for s in stats), "nothing rejected"
    assert rec.checked > 10, f"only {rec.checked} head states checked"
    # Captured features are the target's final hidden states of the whole text.
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    by_prompt = {tuple(p): p + o for p, o in zip(PROMPTS, outs)}
    for rid, feats in rec.features.items():
        text = by_prompt[rec.prompts[rid]]
        with torch.no_grad():
            want = hf.model(torch.tensor([text])).last_hidden_state[0]
        assert sorted(feats) == list(range(len(text) - 1)), f"{rid}: features missing"
        for pos, got in feats.items():
            assert torch.allclose(got, want[pos], atol=1e-4), f"{rid}: feature {pos} differs"
    assert_no_blocks_held(e)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "incremental"])
def test_greedy_output_equals_incremental_with_the_eagle_drafter(pair, policy):
    target, head = pair
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, slo_tpot_ms=s) for s in SLOS
    ]
    ref, _ = run(make_engine(target, None, "incremental"), PROMPTS, params)
    e = make_engine(target, head, policy, drafter="eagle")
    if policy == "adaserve":  # control drafts only where it pays: next to a costly target
        slow_forwards(e, lambda n: 0.05)
    outs, stats = run(e, PROMPTS, params)
    assert outs == ref, f"{policy} with the EAGLE drafter changed the greedy output"
    assert any(s.drafted for s in stats), "the head never drafted"
    assert_no_blocks_held(e)


def test_eagle_plus_suffix_is_lossless_and_auto_picks_the_head(pair):
    target, head = pair
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    ref, _ = run(make_engine(target, None, "incremental"), PROMPTS, params)
    e = make_engine(target, head, "adaserve_paper", drafter="eagle+suffix")
    assert run(e, PROMPTS, params)[0] == ref
    auto = make_engine(target, head, "adaserve_paper")
    assert isinstance(auto.scheduler.drafter, EagleDrafter), "auto did not pick the head"


def test_head_checkpoint_layout_round_trips_and_is_recognised(pair, tmp_path):
    target_dir, head_dir = pair
    target = load_model(target_dir)
    head = load_eagle_head(head_dir, target)
    assert is_eagle_head(head_dir) and not is_eagle_head(target_dir)
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    h = target.args.hidden_size
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names), "target tensors stored"
    # A published EAGLE-1 checkpoint: pytorch_model.bin, with the embedding copy it carries.
    state = dict(head.state_to_save())
    state["embed_tokens.weight"] = target.embed_tokens.weight.clone()
    (tmp_path / "pub").mkdir()
    torch.save(state, tmp_path / "pub" / "pytorch_model.bin")
    (tmp_path / "pub" / "config.json").write_text((head_dir / "config.json").read_text())
    again = load_eagle_head(tmp_path / "pub", target)
    for (name, a), b in zip(again.state_dict().items(), head.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after loading the published layout"
    assert again.fc.weight.shape == (h, 2 * h)
