"""Hands the sandbox layer its settings from Django settings, once and after every override.

``sandboxes`` never reads Django settings itself (``sandboxes.settings``): this module builds its
typed ``SandboxSettings`` from ours when the apps are ready (``CoreConfig.ready``), and again when a
test changes one of the settings it is built from (``setting_changed``).
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from sandboxes.settings import SEMANTIC_SETTING_NAMES, SandboxSettings, configure

SOURCE_SETTINGS = frozenset({"SANDBOX_BACKEND", "SANDBOX_ROOT", "SANDBOX_IMAGE", "SANDBOX_DOCKER_RUNTIME",
                             "GIT_ALLOWED_HOSTS", "DATABASES", "ARCHIVE_MAX_DEPTH",
                             *SEMANTIC_SETTING_NAMES})
"""The Django settings ``sandbox_settings_from_django`` reads."""


def sandbox_settings_from_django() -> SandboxSettings:
    semantic = {name: str(getattr(settings, name)) for name in SEMANTIC_SETTING_NAMES
                if getattr(settings, name, None) is not None}
    return SandboxSettings(
        backend=str(getattr(settings, "SANDBOX_BACKEND", "local")),
        root=Path(settings.SANDBOX_ROOT).absolute(),
        image=str(settings.SANDBOX_IMAGE),
        docker_runtime=str(getattr(settings, "SANDBOX_DOCKER_RUNTIME", "runc")),
        git_allowed_hosts=tuple(str(host).lower() for host in getattr(settings, "GIT_ALLOWED_HOSTS", [])),
        archive_max_depth=int(getattr(settings, "ARCHIVE_MAX_DEPTH", 64)),
        semantic=semantic,
        # The dict itself, not a copy: the test runner renames the database in place after start-up.
        database=settings.DATABASES.get("default"),
    )


def sandbox_settings_push(**_signal) -> None:
    """Configure the sandbox layer from the current Django settings."""
    configure(sandbox_settings_from_django())


def sandbox_settings_changed(*, setting: str, **_signal) -> None:
    """``setting_changed`` receiver: push again when a setting the sandbox layer uses changed."""
    if setting in SOURCE_SETTINGS:
        sandbox_settings_push()
