"""Build the application image for compose.yaml offline (debootstrap + pip wheels + docker import)."""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from sandboxes.image import ImageBuildError
from webapp.core.app_image import AppImageConfig, app_image_build


class Command(BaseCommand):
    help = "Build the Flowstate application image (web, workers, Ray, PostgreSQL, Redis) from the Debian mirror."

    def add_arguments(self, parser):
        parser.add_argument("--image", default="flowstate-app:latest", help="image reference to create")
        parser.add_argument("--force", action="store_true", help="rebuild the base rootfs and re-import")
        parser.add_argument("--mirror", default=None, help="Debian mirror URL (default: from apt sources)")
        parser.add_argument("--cache-dir", default=None,
                            help="base rootfs and wheel cache (default STATE_DIR/cache/app-image)")

    def handle(self, *args, **options):
        logging.basicConfig(level=logging.INFO if options["verbosity"] >= 1 else logging.WARNING)
        try:
            config = AppImageConfig(image=options["image"], mirror=options["mirror"],
                                    cache_dir=Path(options["cache_dir"] or settings.STATE_DIR / "cache" / "app-image"))
            image_id = app_image_build(config=config, force=options["force"])
        except (ImageBuildError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{config.image}: {image_id}")
