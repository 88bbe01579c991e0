"""Account writes: users are created by an admin or a management command; there is no sign-up."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction
from rest_framework.authtoken.models import Token

from webapp.accounts.models import Team


@transaction.atomic
def user_create(*, username: str, password: str, email: str = "", is_staff: bool = False, team_names: tuple[str, ...] = ()):
    User = get_user_model()
    if User.objects.filter(username=username).exists():
        raise ValueError(f"user {username!r} already exists")
    user = User.objects.create_user(username=username, password=password, email=email, is_staff=is_staff)
    for name in team_names:
        team, _ = Team.objects.get_or_create(name=name)
        team.members.add(user)
    return user


@transaction.atomic
def api_token_rotate(*, user) -> str:
    Token.objects.filter(user=user).delete()
    return Token.objects.create(user=user).key


def api_token_get_or_create(*, user) -> str:
    token, _ = Token.objects.get_or_create(user=user)
    return token.key
