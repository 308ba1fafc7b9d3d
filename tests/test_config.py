"""Settings come from BATCHAPI_* variables, and bad ones fail naming the variable."""

from pathlib import Path

import pytest

from batchapi.config import SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("BATCHAPI_"):
            monkeypatch.delenv(name)


def test_defaults_are_the_embedded_service(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHAPI_DATA_DIR", str(tmp_path))
    settings = load_settings()
    assert settings.embedded
    assert settings.sqlalchemy_url == f"sqlite:///{tmp_path / 'batchapi.db'}"
    assert settings.resolved_storage_url == f"file://{tmp_path / 'storage'}"
    assert settings.model == "smollm2-135m-instruct"
    assert settings.model_cache == Path("~/.cache/batchapi").expanduser()


def test_plain_postgres_url_gets_a_driver(monkeypatch):
    monkeypatch.setenv("BATCHAPI_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/db")
    monkeypatch.setenv("BATCHAPI_BROKER_URL", "redis://127.0.0.1:6379/0")
    settings = load_settings()
    assert settings.sqlalchemy_url == "postgresql+psycopg://postgres@127.0.0.1:5432/db"
    assert not settings.embedded


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BATCHAPI_DTYPE", "int4"),
        ("BATCHAPI_DEVICE", "tpu"),
        ("BATCHAPI_DATABASE_URL", "mysql://x"),
        ("BATCHAPI_STORAGE_URL", "ftp://bucket"),
        ("BATCHAPI_BROKER_URL", "kafka://x"),
        ("BATCHAPI_PORT", "seventy"),
        ("BATCHAPI_MAX_NUM_SEQS", "0"),
        ("BATCHAPI_KERNELS", "cuda"),
        ("BATCHAPI_COOKIE_SECURE", "sometimes"),
    ],
)
def test_invalid_setting_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        load_settings()


def test_cookie_secure_is_auto_unless_set(monkeypatch):
    assert load_settings().cookie_secure == "auto"
    monkeypatch.setenv("BATCHAPI_COOKIE_SECURE", "true")
    assert load_settings().cookie_secure == "true"


def test_public_url_is_an_http_url_without_its_trailing_slash(monkeypatch):
    assert load_settings().public_url == ""
    monkeypatch.setenv("BATCHAPI_PUBLIC_URL", "https://batch.example.com/api/")
    assert load_settings().public_url == "https://batch.example.com/api"
    for bad in ("batch.example.com", "ftp://batch.example.com", "https://batch.example.com/?x=1"):
        monkeypatch.setenv("BATCHAPI_PUBLIC_URL", bad)
        with pytest.raises(SettingsError, match="BATCHAPI_PUBLIC_URL"):
            load_settings()


def test_heartbeat_must_fit_in_the_lease(monkeypatch):
    monkeypatch.setenv("BATCHAPI_LEASE_SECONDS", "10")
    monkeypatch.setenv("BATCHAPI_HEARTBEAT_SECONDS", "8")
    with pytest.raises(SettingsError, match="BATCHAPI_HEARTBEAT_SECONDS"):
        load_settings()


def test_cli_reports_bad_settings_without_a_traceback(monkeypatch, capsys):
    from batchapi.cli import main

    monkeypatch.setenv("BATCHAPI_DTYPE", "int4")
    with pytest.raises(SystemExit) as exc:
        main(["models", "list"])
    assert exc.value.code == 2
    assert "BATCHAPI_DTYPE" in capsys.readouterr().err


def test_dtype_and_kernel_choices_are_the_engines():
    """config.py may not import the engine, so its lists are checked against the engine's here."""
    from typing import get_args

    from batchapi.config import Settings
    from batchapi.engine.config import DTYPES, KERNELS, PREFAULTS
    from batchapi.kernels import MODES

    assert get_args(Settings.model_fields["dtype"].annotation) == DTYPES
    assert get_args(Settings.model_fields["kernels"].annotation) == KERNELS == MODES
    assert get_args(Settings.model_fields["kv_pool_prefault"].annotation) == PREFAULTS


def test_served_models_default_to_both_default_models_and_read_a_comma_list(monkeypatch):
    from batchapi.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL, Settings

    monkeypatch.delenv("BATCHAPI_MODELS", raising=False)
    monkeypatch.delenv("BATCHAPI_MODEL", raising=False)
    assert Settings().served_models == [DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL]
    assert Settings(model="/models/llama").served_models == ["/models/llama"]  # BATCHAPI_MODEL alone: that model
    monkeypatch.setenv("BATCHAPI_MODELS", " /models/llama , all-minilm-l6-v2,")
    assert Settings().served_models == ["/models/llama", "all-minilm-l6-v2"]
    assert Settings().max_embedding_inputs == 50_000


def test_webhook_hosts_are_a_list_of_names_and_networks(monkeypatch):
    assert load_settings().webhook_allow_private is False
    monkeypatch.setenv("BATCHAPI_WEBHOOK_ALLOW_PRIVATE", "true")
    monkeypatch.setenv("BATCHAPI_WEBHOOK_ALLOWED_HOSTS", " Hooks.Internal. , 10.1.0.0/16,fd00::/8,,192.168.1.7")
    settings = load_settings()
    assert settings.webhook_allow_private is True
    assert settings.webhook_allowed_hosts == ["hooks.internal", "10.1.0.0/16", "fd00::/8", "192.168.1.7"]
    for bad in ("10.1.0.0/33", "10.0.0.300", "fd00::zz"):
        monkeypatch.setenv("BATCHAPI_WEBHOOK_ALLOWED_HOSTS", bad)
        with pytest.raises(SettingsError, match="BATCHAPI_WEBHOOK_ALLOWED_HOSTS"):
            load_settings()
