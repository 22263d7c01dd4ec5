"""deploy/: compose file, Prometheus config and the Grafana dashboard, checked against the server.

The live test runs a real adaserve server and a real Prometheus (Debian's `prometheus`, which
`.ci/run` installs) on loopback and evaluates every PromQL query of the dashboard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from adaserve.api.metrics import ServerMetrics
from adaserve.config import ServerConfig
from tests.e2e.harness import free_port, serve_subprocess, wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "adaserve.json"
NEED_PROMETHEUS = os.environ.get("ADASERVE_REQUIRE_PROMETHEUS") == "1"


def prometheus_binaries() -> tuple[str, str]:
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        if NEED_PROMETHEUS:
            pytest.fail("prometheus/promtool not installed but ADASERVE_REQUIRE_PROMETHEUS=1")
        pytest.skip("Prometheus not installed (apt-get install prometheus; .ci/run does it)")
    return prom, tool


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def exported_metric_names() -> set[str]:
    """Every sample name the server's registry can export."""
    metrics = ServerMetrics(ServerConfig().slo_classes)
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "histogram":
            names.update(f"{family.name}_{s}" for s in ("bucket", "sum", "count"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-host.yml"])
def test_promtool_accepts_the_prometheus_config(config):
    _, promtool = prometheus_binaries()
    out = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / config)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_file_parses_and_everything_it_references_exists():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"adaserve", "adaserve-b", "prometheus", "grafana"} <= set(services)
    assert services["adaserve-b"].get("profiles") == ["replica"], "second replica must be optional"
    for name in ("adaserve", "adaserve-b"):  # the drain (30 s by default) fits the grace
        grace = services[name].get("stop_grace_period", "10s")
        assert int(grace.removesuffix("s")) > 30, f"{name}: stop_grace_period {grace} < drain"
    build = services["adaserve"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), "Dockerfile missing"
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name} mounts {src}, which does not exist"
    for named in [
        v.split(":")[0]
        for s in services.values()
        for v in s.get("volumes", [])
        if not v.startswith(".")
    ]:
        assert named in compose.get("volumes", {}), f"named volume {named} not declared"
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = [
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    assert {"adaserve:8000", "adaserve-b:8000"} <= set(targets), (
        "Prometheus must scrape both replicas"
    )
    assert prom["global"]["scrape_interval"] == "5s"


def test_the_host_compose_file_watches_the_server_make_serve_starts():
    """docker-compose.host.yml runs no server of its own: its Prometheus scrapes the address
    `adaserve serve` listens on by default, and its Grafana reads that Prometheus."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.host.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}, "the host file must start no server"
    for name, svc in services.items():
        assert svc.get("network_mode") == "host", f"{name} cannot reach the host's loopback"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            assert (DEPLOY / src).exists(), f"{name} mounts {src}, which does not exist"
    mounted = {v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert mounted == {"./prometheus-host.yml"}
    prom = yaml.safe_load((DEPLOY / "prometheus-host.yml").read_text())
    targets = [
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    default = ServerConfig()
    assert targets == [f"{default.host}:{default.port}"], f"scrapes {targets}, not the default"
    # One Grafana provisioning for both files: each sets the Prometheus it reads.
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "${ADASERVE_PROMETHEUS_URL}"
    listen = next(
        a.split("=", 1)[1]
        for a in services["prometheus"]["command"]
        if a.startswith("--web.listen-address=")
    )
    env = services["grafana"]["environment"]
    assert env["ADASERVE_PROMETHEUS_URL"] == f"http://{listen}"
    own = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert own["grafana"]["environment"]["ADASERVE_PROMETHEUS_URL"] == "http://prometheus:9090"


def test_dashboard_is_grafana_json_and_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    exported = exported_metric_names()
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == datasource["uid"], f"panel {p['title']!r}: datasource"
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), f"panel {p['title']!r}: gridPos"
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            for name in re.findall(r"\badaserve_[a-z_]+", t["expr"]):
                assert name in exported, f"panel {p['title']!r} queries {name}, not exported"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "slo attainment",
        "goodput",
        "tpot",
        "ttft",
        "accepted",
        "budget",
        "draft",
        "running",
        "kv",
    ):
        assert topic in titles, f"dashboard lacks a {topic} panel"


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    prometheus, _ = prometheus_binaries()
    # Plain queueing: every class must get served requests for its queries to have data.
    with serve_subprocess(
        "--policy",
        "adaserve",
        "--budget",
        "8",
        "--slo-classes",
        "urgent=50,normal=150,relaxed=inf",
        "--admission",
        "queue",
    ) as url:
        port = free_port()
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
        config["scrape_configs"][0]["static_configs"] = [
            {"targets": [url.removeprefix("http://")], "labels": {"replica": "a"}}
        ]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        api = f"http://127.0.0.1:{port}/api/v1/query"
        try:

            def query(expr: str) -> list:
                r = httpx.get(api, params={"query": expr}, timeout=10)
                assert r.status_code == 200, f"{expr}: HTTP {r.status_code} {r.text[:300]}"
                return r.json()["data"]["result"]

            def scraped() -> bool:
                try:
                    return any(s["value"][1] == "1" for s in query("up"))
                except (httpx.TransportError, AssertionError):
                    return False

            wait_for(scraped, 60, "Prometheus to scrape the server")
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            slos = [20.0, 100.0, 1000.0, None] * 3  # urgent, normal, relaxed, none

            def send(slo: float | None) -> int:
                body = {
                    "model": model,
                    "prompt": "Count to ten:",
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                if slo is not None:
                    body["slo_tpot_ms"] = slo
                return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code

            with ThreadPoolExecutor(6) as pool:
                assert set(pool.map(send, slos)) == {200}
            wait_for(
                lambda: (
                    query("sum(adaserve_requests_total)")
                    and float(query("sum(adaserve_requests_total)")[0]["value"][1]) == len(slos)
                ),
                60,
                "Prometheus to see every finished request",
            )

            # The calibration panels show what verified tree nodes did: speculation control
            # may verify none in a 12-request run (when the costs it measured on this machine
            # say no node pays), and then they must be empty, not made up. Every other panel
            # must have data either way.
            verified = query("sum(adaserve_spec_decode_num_draft_tokens_total)")
            some_verified = bool(verified) and float(verified[0]["value"][1]) > 0
            calibration = [e for e in dashboard_queries() if "adaserve_calibration_" in e]
            expected = [e for e in dashboard_queries() if some_verified or e not in calibration]
            assert calibration and len(expected) > len(calibration)

            # rate() needs two scrapes after the load inside its window: poll until every query
            # has data, then report the ones that never got any.
            def empty() -> list[str]:
                return [e for e in expected if not query(e)]

            try:
                wait_for(lambda: not empty(), 30, "every dashboard query to return data", 1.0)
            except AssertionError:
                pass
            assert not empty(), f"dashboard queries that returned no data: {empty()}"
            if not some_verified:
                assert not [e for e in calibration if query(e)], (
                    "calibration panels have data although no tree node was verified"
                )
        finally:
            prom.terminate()
            prom.wait(timeout=30)
