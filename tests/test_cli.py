"""The generated CLI: every config field is a flag, ADASERVE_* and --config layer under the
command line, vLLM's spellings map onto our fields, and --help reads by layer."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from adaserve.args import engine_configs, server_config
from adaserve.cli import build_parser
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from adaserve.config_flags import add_config_arguments, field_default, flag_name
from adaserve.config_sources import LayeredParser, add_config_file_argument, env_var
from adaserve.flag_table import CHOICES, GROUPS

ENGINE = (ModelConfig, CacheConfig, SchedulerConfig)
ALL_FIELDS = [(cls, f) for cls in (*ENGINE, ServerConfig) for f in fields(cls)]


def other_value(cls: type, f: Field[Any]) -> tuple[list[str], Any]:
    """Command-line words that set field `f` to a value other than its default, and that
    value as the config should hold it."""
    name, flag, default = f.name, flag_name(f.name), field_default(f)
    tp = get_type_hints(cls)[name]
    inner = next((a for a in get_args(tp) if a is not type(None)), tp)
    if name == "model":
        return ["/some/model"], "/some/model"
    if name in ("revision", "gguf_file"):  # these pick files of a named model
        value = "x.gguf" if name == "gguf_file" else "x-revision"
        return ["acme/model", flag, value], value
    if name in CHOICES:
        choice = next(c for c in reversed(CHOICES[name]) if c not in (default, "adaserve"))
        return [flag, choice], choice
    if tp is bool:
        return [("--no-" + flag[2:]) if default else flag], not default
    if name == "slo_classes":
        return [flag, "a=10,b=inf"], (("a", 10.0), ("b", math.inf))
    if get_args(tp) and get_args(tp)[-1] is Ellipsis:
        if get_args(tp)[0] is int:
            return [flag, "2,3"], (2, 3)
        return [flag, "a", flag, "b"], ("a", "b")  # repeatable lists add up
    if inner is int:
        value = (default or 1) + 1
        return [flag, str(value)], value
    if inner is float:
        value = default / 2 if default else 0.5
        return [flag, str(value)], value
    assert inner is str, f"no test value for {name}: {tp}"
    return [flag, f"x-{name}"], f"x-{name}"


def configs(a: argparse.Namespace, with_server: bool = True) -> dict[type, Any]:
    built = dict(zip(ENGINE, engine_configs(a), strict=True))
    if with_server:
        built[ServerConfig] = server_config(a)
    return built


def serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("cls,f", ALL_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in ALL_FIELDS])
def test_every_config_field_is_reachable_from_serve(cls: type, f: Field[Any]) -> None:
    words, want = other_value(cls, f)
    assert want != field_default(f), f"test picked the default of {f.name}"
    got = getattr(configs(serve(*words))[cls], f.name)
    assert got == want, f"`adaserve serve {' '.join(words)}` gave {cls.__name__}.{f.name}={got!r}"


@pytest.mark.parametrize("cls,f", [(c, f) for c, f in ALL_FIELDS if c in ENGINE])
def test_every_engine_field_is_reachable_from_generate(cls: type, f: Field[Any]) -> None:
    words, want = other_value(cls, f)
    a = build_parser().parse_args(["generate", "hello", *words])
    got = getattr(configs(a, with_server=False)[cls], f.name)
    assert a.prompt == "hello" and got == want, f"generate {words}: {f.name}={got!r}"


def test_a_new_field_of_a_plain_type_needs_no_table_entry() -> None:
    @dataclass(frozen=True)
    class Extended:
        widget_name: str | None = None
        enable_widgets: bool = False
        num_things: int = 3

    p = LayeredParser(prog="x")
    add_config_file_argument(p)
    add_config_arguments(p, (Extended,))
    a = p.parse_args(["--widget-name", "v2", "--enable-widgets", "--num-things", "5"])
    assert (a.widget_name, a.enable_widgets, a.num_things) == ("v2", True, 5)
    assert p.parse_args(["--widget-name", "none"]).widget_name is None
    assert "Extended.widget_name (see adaserve/config.py)" in p.format_help()


def test_command_line_beats_env_beats_config_file_beats_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 8\nport: 9001\nblock-size: 32\nhost: 0.0.0.0\n")
    monkeypatch.setenv("ADASERVE_PORT", "9002")
    monkeypatch.setenv("ADASERVE_BLOCK_SIZE", "64")
    a = serve("--config", str(cfg), "--block-size", "128")
    model, cache, sched = engine_configs(a)
    assert sched.max_num_seqs == 8, "the config file did not set max_num_seqs"
    assert a.host == "0.0.0.0" and a.port == 9002, "the environment must win over the file"
    assert cache.block_size == 128, "the command line must win over the environment"
    assert sched.max_depth == SchedulerConfig.max_depth and model.device == "cpu"


def test_config_file_in_json_sets_switches_lists_and_the_model(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.json"
    body = {
        "model": "/m",
        "no-prefix-caching": True,
        "chunked_prefill": False,
        "api-key": ["k1", "k2"],
        "slo_classes": {"fast": 20, "slow": "inf"},
        "specinfer_expansion": [2, 2],
        "draft_vocab_size": None,
    }
    cfg.write_text(json.dumps(body))
    a = serve(f"--config={cfg}")
    built = configs(a)
    assert a.model == "/m" and built[ModelConfig].draft_vocab_size is None
    assert not built[CacheConfig].enable_prefix_caching, "no-prefix-caching: true"
    assert not built[SchedulerConfig].chunked_prefill, "chunked_prefill: false"
    assert built[ServerConfig].api_keys == ("k1", "k2")
    assert built[ServerConfig].slo_classes == (("fast", 20.0), ("slow", math.inf))
    assert built[SchedulerConfig].specinfer_expansion == (2, 2)


def test_a_second_parse_starts_from_the_defaults_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text('{"max-num-seqs": 5, "disable-log-stats": true}')
    parser = build_parser()
    a = parser.parse_args(["serve", "--config", str(cfg)])
    assert a.max_num_seqs == 5 and a.log_stats_interval_s == 0
    monkeypatch.setenv("ADASERVE_PORT", "9100")
    b = parser.parse_args(["serve"])
    assert b.max_num_seqs == SchedulerConfig.max_num_seqs, "the first parse's file stuck"
    assert b.log_stats_interval_s == ServerConfig.log_stats_interval_s and b.port == 9100


def test_adaserve_config_variable_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text('{"max-num-seqs": 5}')
    monkeypatch.setenv("ADASERVE_CONFIG", str(cfg))
    assert serve().max_num_seqs == 5


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2, "a usage error must exit 2"
    return capsys.readouterr().err


def test_unknown_config_key_is_named_with_close_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seq: 8\n")
    err = error_of(["serve", "--config", str(cfg)], capsys)
    assert "unknown key 'max_num_seq'" in err and "max-num-seqs" in err, err


def test_bad_config_value_names_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: fastest\n")
    err = error_of(["serve", "--config", str(cfg)], capsys)
    assert f"{cfg}: policy" in err and "invalid choice 'fastest'" in err, err


@pytest.mark.parametrize(
    "name,text", [("c.json", "{port: 1"), ("c.yaml", "port: [1"), ("c.yaml", "- 1")]
)
def test_a_config_file_that_does_not_parse_is_named(
    name: str, text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / name
    cfg.write_text(text)
    err = error_of(["serve", "--config", str(cfg)], capsys)
    assert f"--config {cfg}: " in err, err


def test_yaml_without_pyyaml_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    assert "pip install pyyaml" in error_of(["serve", "--config", str(cfg)], capsys)


@pytest.mark.parametrize(
    "var,value", [("ADASERVE_MAX_NUM_SEQS", "lots"), ("ADASERVE_CHUNKED_PREFILL", "maybe")]
)
def test_bad_env_value_names_the_variable(
    var: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(var, value)
    err = error_of(["serve"], capsys)
    assert var in err and repr(value) in err, err


def test_env_switches_lists_and_replacing_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_var("enable_prefix_caching"), "false")
    monkeypatch.setenv(env_var("allowed_methods"), "GET,POST")
    monkeypatch.setenv(env_var("budget"), "24")
    a = serve()
    assert not a.enable_prefix_caching and a.allowed_methods == ("GET", "POST")
    assert a.budget == 24, "ADASERVE_BUDGET is an explicit budget (no start-up profile)"
    assert serve("--allowed-methods", "PUT").allowed_methods == ("PUT",), "CLI replaces env"
    assert serve("--enable-prefix-caching").enable_prefix_caching


def test_switches_negate_in_every_spelling() -> None:
    assert not serve("--no-prefix-caching").enable_prefix_caching
    assert not serve("--no-enable-prefix-caching").enable_prefix_caching
    assert serve("--no-prefix-caching", "--prefix-caching").enable_prefix_caching
    assert not serve("--no-chunked-prefill").chunked_prefill
    assert not serve("--no-enable-chunked-prefill").chunked_prefill
    assert not serve("--no-cuda-graphs").cuda_graphs and serve("--vllm-metrics").vllm_metrics


def test_hand_written_spellings_still_work(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k3\n")
    a = serve(
        "/m", "--drain-timeout", "3", "--log-stats-interval", "2", "--api-key", "k1",
        "--api-key", "k2", "--api-key-file", str(keys), "--allowed-origins", "a,b",
        "--allowed-origins", "c",
    )  # fmt: skip
    cfg = server_config(a)
    assert a.model == "/m" and cfg.shutdown_timeout_s == 3 and cfg.log_stats_interval_s == 2
    assert cfg.api_keys == ("k1", "k2", "k3") and cfg.allowed_origins == ("a", "b", "c")
    assert serve("--shutdown-timeout", "4").shutdown_timeout_s == 4
    assert serve().budget is None, "serve without --budget takes B from a profile"
    assert engine_configs(serve())[2].budget == SchedulerConfig.budget


def test_vllm_spellings_map_onto_our_fields() -> None:
    a = serve(
        "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "99",
        "--uvicorn-log-level", "debug", "--disable-log-stats", "-tp", "1",
        "--allowed-origins", '["https://a.example"]', "--max-num-batched-tokens", "512",
        "--dtype", "half",
    )  # fmt: skip
    model, cache, sched = engine_configs(a)
    assert model.dtype == "float16"
    assert (cache.memory_fraction, cache.num_blocks) == (0.5, 99)
    assert a.log_level == "debug" and a.log_stats_interval_s == 0.0
    assert a.allowed_origins == ("https://a.example",) and sched.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    "spec,want",
    [
        ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
         {"drafter": "suffix", "suffix_max_depth": 5, "suffix_max_ngram": 4}),
        ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3},
         {"drafter": "model", "draft_model": "/d", "max_depth": 3}),
        ({"method": "eagle", "model": "/head"}, {"drafter": "eagle", "draft_model": "/head"}),
        ({"model": "/d"}, {"drafter": "auto", "draft_model": "/d"}),
    ],
)  # fmt: skip
def test_speculative_config_maps_onto_drafter_fields(
    spec: dict[str, Any], want: dict[str, Any]
) -> None:
    model, _, sched = engine_configs(serve("--speculative-config", json.dumps(spec)))
    got = {k: getattr(model if hasattr(model, k) else sched, k) for k in want}
    assert got == want


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'],
         "no equivalent of draft_tensor_parallel_size"),
        (["--speculative-config", '{"method": "medusa"}'], "method must be one of"),
        (["--speculative-config", "[1]"], "expected a JSON object"),
        (["--tensor-parallel-size", "2"], "--replicas"),
        (["--policy", "fastest"], "invalid choice"),
    ],
)  # fmt: skip
def test_what_does_not_map_is_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in error_of(["serve", *argv], capsys)


def test_help_is_grouped_by_layer_and_lists_every_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    titles = [t for t in GROUPS if f"\n{t}:\n" in text]
    assert titles == list(GROUPS), f"groups missing from serve --help: {set(GROUPS) - set(titles)}"
    missing = [f.name for _, f in ALL_FIELDS if f.name != "model" and flag_name(f.name) not in text]
    assert not missing, f"fields without a flag in --help: {missing}"
    assert "ADASERVE_" in text and "urgent=50,normal=150,relaxed=inf" in text
