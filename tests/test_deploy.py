"""docker-compose.yml stays in step with the code: every batchapi command it runs parses."""

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


@pytest.mark.parametrize("name", sorted(BATCHAPI_SERVICES))
def test_compose_environment_is_valid_settings(name):
    env = BATCHAPI_SERVICES[name]["environment"]
    fields = {key.removeprefix("BATCHAPI_").lower(): value for key, value in env.items()
              if key.startswith("BATCHAPI_")}
    assert set(fields) <= set(Settings.model_fields), f"unknown settings in {name}"
    fields["model"] = "smollm2-135m-instruct"  # compose defaults it through ${BATCHAPI_MODEL:-...}
    settings = Settings(**fields)
    assert settings.sqlalchemy_url.startswith("postgresql+psycopg://")
    assert not settings.embedded
