"""The demo account's published password opens only a server on loopback: an attacker who reads the
README and reaches a server on another address (or a production one) logs in with nothing."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from rest_framework.authtoken.models import Token

from webapp.core.management.commands import seed_demo
from webapp.core.management.commands.seed_demo import DEMO_PASSWORD, DEMO_USERNAME

pytestmark = pytest.mark.django_db


def _seed(monkeypatch, capsys, host: str | None) -> str:
    # The account is what is tested; the apps' demo data (slow to build) is left out.
    monkeypatch.setattr(seed_demo, "DEMO_APPS", ())
    if host is None:
        monkeypatch.delenv("FLOWSTATE_HOST", raising=False)
    else:
        monkeypatch.setenv("FLOWSTATE_HOST", host)
    call_command("seed_demo")
    return capsys.readouterr().out


def _published_password_logs_in() -> bool:
    return Client().login(username=DEMO_USERNAME, password=DEMO_PASSWORD)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "flowstate.internal"])
def test_off_loopback_the_published_password_does_not_log_in(monkeypatch, capsys, host):
    out = _seed(monkeypatch, capsys, host)
    assert not _published_password_logs_in()
    demo = get_user_model().objects.get(username=DEMO_USERNAME)
    assert not demo.has_usable_password()
    assert DEMO_PASSWORD not in out and "no usable password" in out and host in out, out
    assert "Demo account" in out
    assert not Token.objects.filter(user=demo).exists()


def test_an_account_seeded_on_loopback_is_locked_when_served_elsewhere(monkeypatch, capsys):
    out = _seed(monkeypatch, capsys, None)
    assert _published_password_logs_in() and DEMO_PASSWORD in out
    printed_token = Token.objects.get(user__username=DEMO_USERNAME).key
    out = _seed(monkeypatch, capsys, "0.0.0.0")
    assert not _published_password_logs_in()
    assert printed_token not in out and not Token.objects.filter(key=printed_token).exists()
    # Back on loopback the demo works again as documented.
    _seed(monkeypatch, capsys, "127.0.0.1")
    assert _published_password_logs_in()


def test_a_password_the_operator_set_is_left_alone(monkeypatch, capsys):
    _seed(monkeypatch, capsys, "0.0.0.0")
    demo = get_user_model().objects.get(username=DEMO_USERNAME)
    demo.set_password("operator-chose-this-1")
    demo.save()
    for host in ("0.0.0.0", "::1"):
        _seed(monkeypatch, capsys, host)
        assert Client().login(username=DEMO_USERNAME, password="operator-chose-this-1")


def test_production_profile_never_uses_the_published_password(monkeypatch, capsys, settings):
    settings.PRODUCTION = True
    out = _seed(monkeypatch, capsys, "127.0.0.1")
    assert not _published_password_logs_in() and DEMO_PASSWORD not in out
