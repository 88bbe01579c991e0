"""Create the demo account and each app's demo data. Idempotent: safe on every `make run`."""

import importlib

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from webapp.accounts.services import api_token_get_or_create, user_create

DEMO_USERNAME = "demo"
DEMO_PASSWORD = "flowstate-demo"
# Each app may provide `webapp.<app>.demo.demo_seed(*, user) -> str` (idempotent, returns a summary).
DEMO_APPS = ("agents", "fleet", "experiments")


class Command(BaseCommand):
    help = "Create the demo account (printed) and demo data."

    def handle(self, *args, **options):
        User = get_user_model()
        user = User.objects.filter(username=DEMO_USERNAME).first()
        if user is None:
            user = user_create(username=DEMO_USERNAME, password=DEMO_PASSWORD, is_staff=True, team_names=("demo-team",))
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
        self.stdout.write(self.style.SUCCESS(
            f"Demo account: username '{DEMO_USERNAME}', password '{DEMO_PASSWORD}', API token {api_token_get_or_create(user=user)}"
        ))
