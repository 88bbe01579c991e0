"""Create the demo account and each app's demo data. Idempotent: safe on every `make run`.

The demo account is staff and its password is published (README), so that password is set only
while the app is served on loopback (FLOWSTATE_HOST, `make run`'s default 127.0.0.1) outside the
production profile: anyone who can reach a server on another address would log in with it. Otherwise
the account gets an unusable password (also when it already exists with the published one), loses
the API token earlier loopback runs printed, and the command says so and how to set a password.
"""

import importlib

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from rest_framework.authtoken.models import Token

from webapp.accounts.services import api_token_get_or_create, user_create
from webapp.env import env_str
from webapp.listeners import is_loopback

DEMO_USERNAME = "demo"
DEMO_PASSWORD = "flowstate-demo"
# Each app may provide `webapp.<app>.demo.demo_seed(*, user) -> str` (idempotent, returns a summary).
DEMO_APPS = ("agents", "fleet", "experiments")


def published_password_allowed() -> tuple[bool, str]:
    """Whether the published password may be used, and where the app is served (for the message)."""
    host = env_str("FLOWSTATE_HOST", "127.0.0.1")
    if settings.PRODUCTION:
        return False, f"{host} (production profile)"
    return is_loopback(host), host


class Command(BaseCommand):
    help = "Create the demo account and demo data; the published password only when served on loopback."

    def handle(self, *args, **options):
        allowed, served_on = published_password_allowed()
        user = self._account(allowed=allowed)
        for app in DEMO_APPS:
            try:
                module = importlib.import_module(f"webapp.{app}.demo")
            except ModuleNotFoundError as exc:
                if exc.name != f"webapp.{app}.demo":
                    raise
                continue
            summary = module.demo_seed(user=user)
            if summary:
                self.stdout.write(f"demo data ({app}): {summary}")
        if allowed:
            self.stdout.write(self.style.SUCCESS(
                f"Demo account: username '{DEMO_USERNAME}', password '{DEMO_PASSWORD}', "
                f"API token {api_token_get_or_create(user=user)}"
            ))
            return
        self.stdout.write(self.style.WARNING(
            f"Demo account: username '{DEMO_USERNAME}' has no usable password: the app is served on {served_on}, "
            f"not loopback, and the demo password is published. Set one with "
            f"`python manage.py changepassword {DEMO_USERNAME}`, or serve on 127.0.0.1."
        ))

    @transaction.atomic  # no other connection ever sees the published password on an exposed server
    def _account(self, *, allowed: bool):
        User = get_user_model()
        user = User.objects.filter(username=DEMO_USERNAME).first()
        if user is None:
            user = user_create(username=DEMO_USERNAME, password=DEMO_PASSWORD, is_staff=True, team_names=("demo-team",))
            if not allowed:
                user.set_unusable_password()
                user.save(update_fields=["password"])
        elif not allowed and user.check_password(DEMO_PASSWORD):
            # Made on an earlier loopback run: neither the published password nor the API token that
            # run printed (so maybe into a log) may open the exposed server.
            user.set_unusable_password()
            user.save(update_fields=["password"])
            Token.objects.filter(user=user).delete()
        elif allowed and not user.has_usable_password():
            user.set_password(DEMO_PASSWORD)  # back on loopback: the demo works as documented again
            user.save(update_fields=["password"])
        return user
