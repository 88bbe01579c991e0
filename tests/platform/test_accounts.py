"""Accounts: login/logout, no open sign-up, API tokens, ownership personas."""

import pytest
from django.core.management import call_command
from django.urls import NoReverseMatch, reverse

pytestmark = pytest.mark.django_db


def test_login_page_and_login_flow(client, owner):
    page = client.get("/login/")
    assert page.status_code == 200
    assert b"Log in" in page.content
    bad = client.post("/login/", {"username": "owner", "password": "wrong"})
    assert b"didn't match" in bad.content
    good = client.post("/login/", {"username": "owner", "password": "owner-pass-123"})
    assert good.status_code == 302 and good.url == "/"
    dashboard = client.get("/")
    assert dashboard.status_code == 200
    assert b"Dashboard" in dashboard.content and b"owner" in dashboard.content


def test_logout_requires_post_and_ends_session(client, owner):
    client.force_login(owner)
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302  # back to login


def test_pages_require_login(client):
    response = client.get("/")
    assert response.status_code == 302 and response.url.startswith("/login/")


def test_no_open_signup(client):
    for name in ("signup", "register"):
        with pytest.raises(NoReverseMatch):
            reverse(name)
    assert client.get("/signup/").status_code == 404


def test_create_user_command_prints_token(capsys, team):
    call_command("create_user", "alice", "--password", "alice-pass-123", "--team", team.name)
    out = capsys.readouterr().out
    assert "created alice; API token:" in out
    from django.contrib.auth import get_user_model

    alice = get_user_model().objects.get(username="alice")
    assert alice.check_password("alice-pass-123")
    assert list(alice.teams.values_list("name", flat=True)) == [team.name]


def test_create_user_refuses_duplicates(owner):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="already exists"):
        call_command("create_user", "owner", "--password", "x-pass-12345")


def test_api_token_auth(api_client_for, owner):
    assert api_client_for(None).get("/api/me/").status_code == 401
    response = api_client_for(owner).get("/api/me/")
    assert response.status_code == 200
    assert response.json() == {"username": "owner", "teams": ["ml-infra"]}


def test_rotating_token_revokes_the_old_one(client, api_client_for, owner):
    old_client = api_client_for(owner)
    assert old_client.get("/api/me/").status_code == 200
    client.force_login(owner)
    client.post("/account/")
    assert old_client.get("/api/me/").status_code == 401


def test_openapi_schema_is_published(api_client_for, owner):
    response = api_client_for(owner).get("/api/schema/?format=json")
    assert response.status_code == 200
    assert "/api/me/" in response.json()["paths"]


def test_admin_registers_every_model(admin_client):
    from django.apps import apps
    from django.contrib import admin

    ours = [m for m in apps.get_models() if m.__module__.startswith("webapp.")]
    missing = [m.__name__ for m in ours if not admin.site.is_registered(m)]
    assert not missing, f"models without a Django admin: {missing}"
