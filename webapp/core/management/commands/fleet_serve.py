"""Run the sandbox fleet: host actors on every Ray node with sandbox_slots, plus lost-host detection."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from webapp.fleet.services import fleet_history_prune, hosts_mark_lost


class Command(BaseCommand):
    help = (
        "Start one sandbox host per Ray node (capacity: the node's sandbox_slots resource), place one on "
        "every node that joins later, and mark silent hosts lost until interrupted."
    )

    def add_arguments(self, parser):
        parser.add_argument("--address", default=None,
                            help="Ray cluster address (default: start a local Ray with --slots)")
        parser.add_argument("--slots", type=int, default=8, help="sandbox slots of the local Ray node")
        parser.add_argument("--backend", choices=["local", "docker"], default=None,
                            help="sandbox backend (default settings.SANDBOX_BACKEND)")
        parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval, seconds (<= 2)")
        parser.add_argument("--lost-after", type=float, default=6.0, help="seconds of silence before a host is lost")
        parser.add_argument("--product-reserved-slots", type=int, default=0,
                            help="slots per host kept free for product requests during training bursts")

    def handle(self, *args, **options):
        if options["address"] and "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
            # `ray start --head` enables token auth when ~/.ray/auth_token exists, but a driver joining
            # by address sends the token only in token mode, read when Ray is first imported.
            os.environ["RAY_AUTH_MODE"] = "token"
        import ray
        from django.conf import settings

        from sandboxes.fleet.client import Fleet, FleetConfig

        if options["lost_after"] <= 2 * options["heartbeat"]:
            raise CommandError("--lost-after must exceed two heartbeat intervals, or healthy hosts flap to lost")
        if options["address"]:
            ray.init(address=options["address"], include_dashboard=False)
        else:
            if options["slots"] < 1:
                raise CommandError("--slots must be at least 1")
            ray.init(address="local", resources={"sandbox_slots": options["slots"]}, include_dashboard=False)
        try:
            fleet = Fleet.start(FleetConfig(backend=options["backend"] or settings.SANDBOX_BACKEND,
                                            heartbeat_interval_s=options["heartbeat"],
                                            product_reserved_slots=options["product_reserved_slots"],
                                            follow_interval_s=0))  # the loop below follows (and reports)
        except (ValueError, RuntimeError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"fleet running: {', '.join(f'{h.name} ({h.slots} slots)' for h in fleet.hosts.values())}")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        ticks = 0
        while not stop.wait(1.0):
            # Nodes that joined get a host; hosts of nodes that left stop being offered work.
            added, dropped = fleet.refresh(place=True)
            for name in added:
                self.stdout.write(f"host {name} joined ({fleet.hosts[name].slots} slots)")
            for name in dropped:
                self.stderr.write(f"host {name} left the cluster")
            for name in hosts_mark_lost(stale_after_s=options["lost_after"]):
                self.stderr.write(f"host {name} lost: no heartbeat for {options['lost_after']:g}s")
            ticks += 1
            if ticks % 600 == 0:
                fleet_history_prune()
        self.stdout.write(f"stopping: {fleet.shutdown()} sandboxes destroyed")
        ray.shutdown()
