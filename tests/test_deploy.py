"""docker-compose.yml stays in step with the code: every batchapi command it runs parses, and the
Prometheus and Grafana set-up in deploy/ scrapes what the services serve and charts what they export."""

import json
import re
from pathlib import Path

import pytest
import yaml

from batchapi.cli import build_parser
from batchapi.config import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
BATCHAPI_SERVICES = {name: svc for name, svc in COMPOSE["services"].items() if svc.get("build") == "."}


def test_compose_runs_every_part_of_the_production_stack():
    assert {"postgres", "redis", "minio", "migrate", "api", "worker", "beat"} <= set(COMPOSE["services"])
    gpu = COMPOSE["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


@pytest.mark.parametrize("name", sorted(BATCHAPI_SERVICES))
def test_compose_commands_are_real_cli_commands(name):
    args = build_parser().parse_args(BATCHAPI_SERVICES[name]["command"])
    assert callable(args.func)


def unset(value: str) -> str:
    """``value`` as compose reads it where no variable it names is set (``${VAR:-default}``)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.mark.parametrize("name", sorted(BATCHAPI_SERVICES))
def test_compose_environment_is_valid_settings(name):
    env = BATCHAPI_SERVICES[name]["environment"]
    fields = {key.removeprefix("BATCHAPI_").lower(): unset(value) for key, value in env.items()
              if key.startswith("BATCHAPI_")}
    assert set(fields) <= set(Settings.model_fields), f"unknown settings in {name}"
    settings = Settings(**fields)
    assert settings.sqlalchemy_url.startswith("postgresql+psycopg://")
    assert not settings.embedded
    if name == "api":  # the links it hands out name where a client on the host reaches it
        assert settings.public_url == "http://localhost:8000" and COMPOSE["services"]["api"]["ports"] == ["8000:8000"]


# metrics: Prometheus and Grafana (deploy/)

DEPLOY = ROOT / "deploy"


def exported_names(tmp_path) -> set[str]:
    """Every sample name batchapi's collectors export (the API's on a fresh database, and an engine's)."""
    from batchapi import metrics
    from batchapi.config import load_settings
    from batchapi.db.migrate import upgrade
    from batchapi.db.session import make_engine, make_sessionmaker

    settings = load_settings(data_dir=tmp_path)
    upgrade(settings)
    engine = make_engine(settings)
    registry = metrics.api_registry(make_sessionmaker(engine))
    metrics.HttpMetrics(None, registry)
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    try:
        families = [*registry.collect(), *metrics.EngineStats().registry.collect()]
    finally:
        engine.dispose()
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


def test_prometheus_scrapes_the_api_and_every_worker():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["batchapi-api"]["static_configs"][0]["targets"] == ["api:8000"]
    assert COMPOSE["services"]["api"]["command"][-2:] == ["--port", "8000"]
    [worker] = jobs["batchapi-worker"]["dns_sd_configs"]
    assert worker["names"] == ["worker"]
    assert str(worker["port"]) == COMPOSE["services"]["worker"]["environment"]["BATCHAPI_METRICS_PORT"]
    prometheus = COMPOSE["services"]["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


def test_grafana_is_provisioned_from_deploy():
    grafana = COMPOSE["services"]["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        assert (ROOT / source).is_dir(), source
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/batchapi.json").read_text())
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {source["uid"]}


def test_the_grafana_dashboard_queries_only_metrics_batchapi_exports(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana/dashboards/batchapi.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"batchapi_[a-z_]+", target["expr"])}
    exported = exported_names(tmp_path)
    assert queried and queried <= exported, sorted(queried - exported)
    # and every family is on the dashboard somewhere
    families = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in exported}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in queried}
    assert families <= shown, sorted(families - shown)
