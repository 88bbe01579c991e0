"""Build the sandbox container image offline (debootstrap + docker import); cached between runs."""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from sandboxes.image import ImageBuildError, SandboxImageConfig, sandbox_image_build


class Command(BaseCommand):
    help = "Build settings.SANDBOX_IMAGE from the machine's Debian mirror; skipped when it exists."

    def add_arguments(self, parser):
        parser.add_argument("--force", action="store_true", help="rebuild the rootfs and re-import")
        parser.add_argument("--image", default=None, help="image reference (default settings.SANDBOX_IMAGE)")
        parser.add_argument("--mirror", default=None, help="Debian mirror URL (default: from apt sources)")
        parser.add_argument(
            "--cache-dir",
            default=None,
            help="where the rootfs tarball is kept (default STATE_DIR/cache/sandbox-image)",
        )

    def handle(self, *args, **options):
        logging.basicConfig(level=logging.INFO if options["verbosity"] >= 1 else logging.WARNING)
        try:
            config = SandboxImageConfig(
                image=options["image"] or settings.SANDBOX_IMAGE,
                cache_dir=Path(options["cache_dir"] or settings.STATE_DIR / "cache" / "sandbox-image"),
                mirror=options["mirror"],
            )
            result = sandbox_image_build(config=config, force=options["force"])
        except (ImageBuildError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        action = "built and imported" if result.imported else "already present, skipped"
        self.stdout.write(f"{result.image} {action}: {result.image_id} (rootfs {result.rootfs_tarball})")
