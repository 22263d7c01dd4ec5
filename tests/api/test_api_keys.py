"""API keys: several keys, a key file, /health always open, /metrics open unless protected."""

from __future__ import annotations

import httpx
import pytest

from adaserve.api.server import build_app
from adaserve.args import api_keys
from adaserve.cli import main
from adaserve.config import ServerConfig
from tests.api.test_server_tiny import make_engine
from tests.e2e.harness import ThreadServer

KEYS = ("sk-one", "sk-two")


def get(url: str, path: str, key: str | None) -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{url}{path}", headers=headers, timeout=30).status_code


# (protect_metrics, path, key sent, status)
TABLE = [
    (False, "/v1/models", None, 401),
    (False, "/v1/models", "sk-one", 200),
    (False, "/v1/models", "sk-two", 200),
    (False, "/v1/models", "sk-three", 401),
    (False, "/v1/models", "sk-on", 401),  # a prefix of a key is no key
    (False, "/health", None, 200),
    (False, "/metrics", None, 200),
    (True, "/metrics", None, 401),
    (True, "/metrics", "sk-two", 200),
    (True, "/health", None, 200),
]


@pytest.mark.parametrize("protect", [False, True])
def test_api_key_table(tiny_llama, protect) -> None:
    cfg = ServerConfig(api_keys=KEYS, protect_metrics=protect)
    with ThreadServer(build_app(make_engine(tiny_llama), cfg)) as srv:
        for p, path, key, status in TABLE:
            if p == protect:
                assert get(srv.url, path, key) == status, (path, key, protect)
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={"prompt": "t5", "max_tokens": 2},
            headers={"Authorization": "Bearer wrong"},
            timeout=30,
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_keys_come_from_flags_and_a_file(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-a\n\n  sk-b  \nsk-a\n")
    assert api_keys(["sk-c"], str(f)) == ("sk-c", "sk-a", "sk-b")
    assert api_keys(None, None) == ()
    with pytest.raises(ValueError, match="lists no key"):
        (tmp_path / "empty").write_text("# nothing\n")
        api_keys(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="No such file"):
        api_keys(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="whitespace"):
        api_keys(["sk x"], None)


def test_serve_refuses_a_bad_key_setup_before_loading_a_model(tmp_path, capsys) -> None:
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) != 0
    assert "--api-key-file" in capsys.readouterr().err
    assert main(["serve", "--protect-metrics"]) != 0
    assert "--protect-metrics needs" in capsys.readouterr().err
