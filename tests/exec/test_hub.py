"""Models by hub id, offline, against a hub cache built in the test (tests/hub_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve import LLM, SamplingParams
from adaserve.config import ModelConfig
from adaserve.exec.hub import CHECKPOINT_FILES, TOKENIZER_FILES, hub_cache_dir
from tests.conftest import make_tiny_checkpoint, make_tokenizer
from tests.hub_cache import add_checkpoint_dir

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33], [2, 3, 4]]


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache under a fresh HF_HOME, offline (the hub is never reached)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "hf" / "hub"
    path.mkdir(parents=True)
    return path


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_hub_id_serves_the_cached_snapshot_token_for_token(hub, tiny_llama):
    add_checkpoint_dir(hub, "acme/tiny", tiny_llama)
    llm = LLM(model="acme/tiny", num_blocks=32)
    path = llm.llm_engine.engine.target_path
    assert path.parent.parent == hub / "models--acme--tiny", f"loaded {path}, not the snapshot"
    want = greedy(LLM(model=str(tiny_llama), num_blocks=32))
    assert greedy(llm) == want, "the hub snapshot and the same checkpoint dir differ"


def test_revision_picks_another_snapshot_by_ref_or_commit(hub, tiny_llama, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "v2", seed=7)
    add_checkpoint_dir(hub, "acme/tiny", tiny_llama)
    commit = add_checkpoint_dir(hub, "acme/tiny", other, revision="v2")
    want = greedy(LLM(model=str(other), num_blocks=32))
    assert want != greedy(LLM(model="acme/tiny", num_blocks=32)), "the two models must differ"
    assert greedy(LLM(model="acme/tiny", revision="v2", num_blocks=32)) == want
    assert greedy(LLM(model="acme/tiny", revision=commit, num_blocks=32)) == want


def test_a_tokenizer_override_is_the_tokenizer_used(hub, tiny_llama, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Another spelling of the same 96 ids: w0..w95.
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")
    fast.save_pretrained(tmp_path / "tok")
    for name in (str(tmp_path / "tok"), "acme/tok"):
        if name == "acme/tok":
            add_checkpoint_dir(hub, "acme/tok", tmp_path / "tok")
        llm = LLM(model=str(tiny_llama), tokenizer=name, num_blocks=32)
        out = llm.generate("w5 w9 w20", GREEDY)[0]  # (w1x would split: w1 is EOS)
        assert out.prompt_token_ids == [5, 9, 20], f"{name}: the override did not tokenize"
        assert out.outputs[0].text.startswith("w"), f"{name}: decoded with another tokenizer"
    make_tokenizer(200).save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match="200 tokens, more than the model's 96"):
        LLM(model=str(tiny_llama), tokenizer=str(tmp_path / "big"), num_blocks=32)


def test_offline_and_not_cached_names_the_repo_and_what_to_do(hub):
    with pytest.raises(FileNotFoundError, match="acme/missing.*HF_HUB_OFFLINE"):
        LLM(model="acme/missing")
    with pytest.raises(FileNotFoundError, match="acme/missing@v9.*HF_HUB_OFFLINE"):
        LLM(model="acme/missing", revision="v9")


def test_names_that_are_neither_paths_nor_hub_ids_are_refused(hub, tiny_llama):
    for bad in ("a/b/c", "no spaces/allowed"):
        with pytest.raises(FileNotFoundError, match="not a Hugging Face hub id"):
            LLM(model=bad)
    with pytest.raises(ValueError, match="revision 'v2' picks a version of a hub model"):
        LLM(model=str(tiny_llama), revision="v2")
    with pytest.raises(FileNotFoundError, match="has no 'x.gguf'.*GGUF files there: none"):
        LLM(model=str(tiny_llama), gguf_file="x.gguf")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(revision="v2"), "give model"),
        (dict(gguf_file="m.gguf"), "give model"),
        (dict(model="acme/x", gguf_file="model.bin"), "must name a .gguf file"),
        (dict(model="m.gguf", gguf_file="n.gguf"), "is a GGUF file already"),
        (dict(model="acme/x", tokenizer=""), "tokenizer must be non-empty"),
    ],
)
def test_model_source_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_the_hub_cache_follows_the_environment_at_call_time(monkeypatch, tmp_path):
    """huggingface_hub reads HF_HOME once at import; adaserve passes the cache at each call."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "a"))
    assert hub_cache_dir() == tmp_path / "a" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "b"))
    assert hub_cache_dir() == tmp_path / "b"


def test_only_the_files_adaserve_reads_are_downloaded():
    """What snapshot_download would fetch of a repo that carries several weight formats."""
    from huggingface_hub.utils import filter_repo_objects

    repo = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "pytorch_model.bin",
        "consolidated.pth",
        "model-q4.gguf",
        "onnx/model.onnx",
        "onnx/config.json",
        "original/params.json",
        "README.md",
    ]

    def fetched(allow: list[str]) -> set[str]:
        return set(filter_repo_objects(repo, allow_patterns=allow, ignore_patterns=["*/*"]))

    assert fetched(CHECKPOINT_FILES) == set(repo[:9])
    assert fetched(TOKENIZER_FILES) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }


def test_trust_remote_code_reaches_transformers_and_only_when_asked(tiny_llama, monkeypatch):
    import transformers

    seen: list[bool] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    LLM(model=str(tiny_llama), num_blocks=32)
    LLM(model=str(tiny_llama), num_blocks=32, trust_remote_code=True)
    assert seen == [False, True], f"AutoTokenizer got trust_remote_code {seen}"


def test_an_eagle_head_named_by_hub_id_drafts_as_eagle(hub):
    """With drafter auto, a draft named by hub id is an EAGLE head only once its files are
    here: the scheduler must run the head, not a draft model's drafter."""
    from adaserve.exec.default_model import shipped_head

    head = shipped_head()
    assert head is not None
    add_checkpoint_dir(hub, "acme/smollm2-eagle", head)
    llm = LLM(
        draft_model="acme/smollm2-eagle", policy="adaserve_paper", backend="torch", num_blocks=64
    )
    assert llm.llm_engine.scheduler.drafter is not None
    assert llm.llm_engine.scheduler.drafter.name == "eagle"
    out = llm.generate(
        ["Write a python function that sorts a list."],
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
    )[0]
    assert out.metrics.num_accepted_tokens >= 8, out.metrics


def test_a_hub_snapshot_profile_is_named_by_its_repo(hub, tiny_llama):
    from adaserve.request_manager.control.profile import startup_profile_path

    commit = add_checkpoint_dir(hub, "acme/tiny", tiny_llama)
    llm = LLM(model="acme/tiny", num_blocks=32)
    name = startup_profile_path(llm.llm_engine.engine).name
    assert name.startswith(f"models--acme--tiny@{commit[:12]}__"), name
