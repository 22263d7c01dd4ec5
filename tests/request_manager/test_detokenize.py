"""Incremental detokenization: the streamed text is the whole decode, token by token, and the
engine no longer decodes the whole output again after every token."""

from __future__ import annotations

import random

import pytest

from adaserve import SamplingParams
from adaserve.request_manager.output import OutputProcessor
from adaserve.request_manager.request import Request
from tests.conftest import make_tokenizer


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Mistral): '▁' marks a word start, the decoder
    drops the first one, byte-fallback pieces make multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "</s>", "▁", "▁the", "▁cat", "s", "é", "▁caf", "▁na", "ïve"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")  # type: ignore[arg-type]
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def tokenizers():
    from transformers import AutoTokenizer

    from adaserve.exec.default_model import default_model_dir

    return {
        "word-level (tests' tiny models)": make_tokenizer(96),
        "sentencepiece-style with byte fallback": metaspace_tokenizer(),
        "byte-level BPE (the default model)": AutoTokenizer.from_pretrained(default_model_dir()),
    }


def request(max_tokens: int = 10_000, stop: tuple[str, ...] = ()) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop)
    return Request("r", [1, 2], params, arrival_time=0.0)


@pytest.mark.parametrize("name", list(tokenizers()))
def test_streamed_text_is_the_whole_decode_at_every_token(name):
    tok = tokenizers()[name]
    rng = random.Random(0)
    texts = ["the cats café naïve", "héllo wörld 😀 ✓ 東京", "the the cat s"]
    for trial in range(60):
        if trial < len(texts):
            ids = tok.encode(texts[trial], add_special_tokens=False)
        else:  # any pieces, special tokens included; byte pieces only as valid UTF-8 above
            # (a run of byte pieces that is not UTF-8 decodes whole as one U+FFFD per byte,
            # characters streamed from it before included: there the final text differs)
            pieces = [
                i for i in range(len(tok)) if not tok.convert_ids_to_tokens(i).startswith("<0x")
            ]
            ids = [rng.choice(pieces) for _ in range(rng.randrange(1, 40))]
        final = tok.decode(ids, skip_special_tokens=True)
        proc = OutputProcessor(tok, max_model_len=1 << 20)
        assert proc.backend is not None, "a fast tokenizer must stream"
        req = request()
        streamed = ""
        for t in ids:
            proc.commit(req, [t], now=0.0)
            streamed += proc.make_output(req).delta_text
            assert final.startswith(streamed), f"{name}: streamed {streamed!r}, final {final!r}"
            # Held back: at most an incomplete character or a space that the next token may
            # change (whole decodes of a prefix may show U+FFFD for a byte run in progress).
            whole = tok.decode(req.output_token_ids, skip_special_tokens=True).rstrip("\ufffd")
            assert len(whole) - len(streamed) <= 2, f"{name}: {streamed!r} of {whole!r} sent"
        req.finish("length", 0.0)
        last = proc.make_output(req)
        assert last.outputs[0].text == final
        assert streamed + last.delta_text == final, f"{name}: the stream lost text"


def test_a_stop_string_split_across_tokens_cuts_the_text_where_it_starts():
    tok = make_tokenizer(96)
    proc = OutputProcessor(tok, max_model_len=1 << 20)
    req = request(stop=("t7 t8",))
    sent = ""
    for t in [5, 6, 7, 8, 9]:
        if req.finished:
            break
        proc.commit(req, [t], now=0.0)
        sent += proc.make_output(req).delta_text
    assert req.finish_reason == "stop"
    assert req.stop_text == "t5 t6 "
    assert sent == "t5 t6 ", "the stop string's start was streamed before it completed"


def test_the_engine_decodes_a_long_output_once_not_after_every_token(tiny_llama):
    from adaserve import LLM

    llm = LLM(str(tiny_llama), policy="incremental")
    tok = llm.llm_engine.tokenizer
    calls = []
    real = tok.decode

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    tok.decode = counting
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop=["t1000"])
        (out,) = llm.generate([[3, 4, 5]], params)
    finally:
        tok.decode = real
    assert len(out.outputs[0].token_ids) == 200
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert len(calls) <= 2, f"the whole output was decoded {len(calls)} times for 200 tokens"
