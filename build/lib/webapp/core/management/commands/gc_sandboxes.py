"""Retention pass: dead sandboxes, unused snapshots and unreferenced uploads older than the bound."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from webapp.agents.retention import sandboxes_gc


class Command(BaseCommand):
    help = ("Delete snapshots no live sandbox uses, uploads no repository or unfinished task names, and dead "
            "sandboxes, once older than FLOWSTATE_SANDBOX_RETENTION_S (agent workers also run this hourly).")

    def add_arguments(self, parser):
        parser.add_argument("--max-age-s", type=float, default=None,
                            help=f"age bound in seconds (default {settings.SANDBOX_RETENTION_S})")

    def handle(self, *args, **options):
        max_age = options["max_age_s"]
        if max_age is not None and max_age <= 0:
            raise CommandError("--max-age-s must be positive")
        counts = sandboxes_gc(max_age_s=max_age)
        self.stdout.write(", ".join(f"{key}: {value} removed" for key, value in counts.items()))
