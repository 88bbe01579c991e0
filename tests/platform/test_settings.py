"""Settings come from the environment and refuse bad values loudly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from webapp.env import ConfigurationError, env_bool, env_choice, env_int

ROOT = Path(__file__).resolve().parents[2]


def test_env_bool_rejects_typos(monkeypatch):
    monkeypatch.setenv("FLOWSTATE_FLAG", "ture")
    with pytest.raises(ConfigurationError, match="FLOWSTATE_FLAG='ture' is not a boolean"):
        env_bool("FLOWSTATE_FLAG", default=False)


def test_env_bool_accepts_spellings(monkeypatch):
    monkeypatch.setenv("FLOWSTATE_FLAG", "Yes")
    assert env_bool("FLOWSTATE_FLAG", default=False) is True
    monkeypatch.setenv("FLOWSTATE_FLAG", "off")
    assert env_bool("FLOWSTATE_FLAG", default=True) is False


def test_env_int_bounds(monkeypatch):
    monkeypatch.setenv("FLOWSTATE_N", "abc")
    with pytest.raises(ConfigurationError, match="not an integer"):
        env_int("FLOWSTATE_N", 1)
    monkeypatch.setenv("FLOWSTATE_N", "0")
    with pytest.raises(ConfigurationError, match="below the minimum 1"):
        env_int("FLOWSTATE_N", 1, minimum=1)


def test_env_choice_names_the_options(monkeypatch):
    monkeypatch.setenv("SANDBOX_BACKEND", "dokcer")
    with pytest.raises(ConfigurationError, match=r"'dokcer' is not one of \['local', 'docker'\]"):
        env_choice("SANDBOX_BACKEND", "local", ["local", "docker"])


def _manage(*args, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "SECRET_KEY", "DEBUG")}
    full_env.update(env)
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120)


def test_bad_setting_stops_startup():
    result = _manage("check", SANDBOX_BACKEND="dokcer")
    assert result.returncode != 0
    assert "SANDBOX_BACKEND='dokcer' is not one of" in result.stderr


def test_bad_database_url_stops_startup():
    result = _manage("check", DATABASE_URL="mysql://x@y/z")
    assert result.returncode != 0
    assert "DATABASE_URL must be a sqlite:// or postgres:// URL" in result.stderr


def test_production_refuses_default_secret():
    result = _manage("check", FLOWSTATE_PROFILE="production", ALLOWED_HOSTS="flowstate.example.org")
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_production_profile_passes_check_deploy():
    result = _manage(
        "check", "--deploy", "--fail-level", "WARNING",
        FLOWSTATE_PROFILE="production",
        SECRET_KEY="k" * 20 + "9f8e7d6c5b4a3f2e1d0c9b8a7f6e5d4c3b2a1f0e9d8c7b6a5",
        ALLOWED_HOSTS="flowstate.example.org",
    )
    assert result.returncode == 0, result.stderr + result.stdout


def test_migrations_are_complete():
    result = _manage("makemigrations", "--check", "--dry-run")
    assert result.returncode == 0, f"models changed without migrations:\n{result.stdout}{result.stderr}"
