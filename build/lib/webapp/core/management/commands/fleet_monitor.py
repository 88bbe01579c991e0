"""Lost-host detection on its own, for deployments where the fleet driver runs elsewhere."""

from __future__ import annotations

import signal
import threading

from django.core.management.base import BaseCommand, CommandError

from webapp.fleet.services import fleet_history_prune, hosts_mark_lost


class Command(BaseCommand):
    help = "Mark sandbox hosts lost (with their sandboxes) when their heartbeats stop; prune old history."

    def add_arguments(self, parser):
        parser.add_argument("--lost-after", type=float, default=6.0, help="seconds of silence before a host is lost")
        parser.add_argument("--once", action="store_true", help="check once and exit")

    def handle(self, *args, **options):
        if options["lost_after"] <= 0:
            raise CommandError("--lost-after must be positive")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        ticks = 0
        while True:
            for name in hosts_mark_lost(stale_after_s=options["lost_after"]):
                self.stdout.write(f"host {name} lost")
            ticks += 1
            if options["once"] or stop.wait(1.0):
                break
            if ticks % 600 == 0:
                fleet_history_prune()
