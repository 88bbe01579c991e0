"""Offline build of the sandbox container image.

No container registry is reachable from a Flowstate host, so the image is bootstrapped from the
Debian mirror the machine already uses for apt: debootstrap writes a minimal root filesystem, the
unprivileged ``agent`` user and ``/workspace`` are added inside it, the tree is packed into a
tarball kept under a cache directory (CI builds it once) and ``docker import`` turns the tarball
into the image named by ``settings.SANDBOX_IMAGE``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PACKAGES: tuple[str, ...] = (
    "python3",
    "python3-pytest",
    "python3-pyflakes",
    "git",
    "ripgrep",
    "ca-certificates",
)
APT_SOURCE_PATHS: tuple[Path, ...] = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))


class ImageBuildError(RuntimeError):
    """The sandbox image could not be built; the message says which step failed and why."""


@dataclass(frozen=True)
class SandboxImageConfig:
    """What goes into the sandbox image and where the build keeps its cache."""

    image: str
    """Docker reference to create, ``repository:tag`` (normally ``settings.SANDBOX_IMAGE``)."""
    cache_dir: Path
    """Directory that keeps the root filesystem tarball between builds."""
    suite: str = "bookworm"
    """Debian release to bootstrap; the apt sources must list a mirror that carries it."""
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    """Debian packages installed on top of the ``minbase`` variant."""
    agent_uid: int = 1000
    """Numeric id of the unprivileged ``agent`` user that runs every sandbox command."""
    workspace: str = "/workspace"
    """Absolute path of the agent's working tree inside the container."""
    mirror: str | None = None
    """Debian mirror URL; ``None`` reads it from the machine's apt sources (never hard-coded)."""
    extra_labels: dict[str, str] = field(default_factory=dict)
    """Labels added to the imported image besides the build fingerprint."""

    def __post_init__(self) -> None:
        if ":" not in self.image.rsplit("/", 1)[-1]:
            raise ValueError(f"image={self.image!r} needs an explicit tag, e.g. {self.image}:latest")
        if not self.workspace.startswith("/") or self.workspace == "/":
            raise ValueError(f"workspace={self.workspace!r} must be an absolute directory other than /")
        if not 1 <= self.agent_uid < 65534:
            raise ValueError(f"agent_uid={self.agent_uid} must be an ordinary user id (1..65533), not root")
        if not self.packages:
            raise ValueError("packages is empty; the sandbox needs at least python3 and git")

    def fingerprint(self, mirror: str) -> str:
        """Stable hash of every input that changes the root filesystem."""
        payload = json.dumps(
            {
                "suite": self.suite,
                "packages": sorted(self.packages),
                "uid": self.agent_uid,
                "workspace": self.workspace,
                "mirror": mirror,
                "layout": 2,
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ImageBuildResult:
    image: str
    image_id: str
    rootfs_tarball: Path
    built_rootfs: bool
    imported: bool


def apt_mirror_for_suite(*, suite: str, source_paths: tuple[Path, ...] = APT_SOURCE_PATHS) -> str:
    """The first ``deb`` mirror in the apt sources that serves ``suite`` itself (not -security)."""
    for uri, suites in _apt_sources(source_paths):
        if suite in suites:
            return uri.rstrip("/")
    searched = ", ".join(str(p) for p in source_paths)
    raise ImageBuildError(
        f"no 'deb' apt source for suite {suite!r} in {searched}; add one or pass --mirror explicitly"
    )


def _apt_sources(source_paths: tuple[Path, ...]) -> list[tuple[str, list[str]]]:
    files: list[Path] = []
    for path in source_paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in {".list", ".sources"}))
        elif path.is_file():
            files.append(path)
    entries: list[tuple[str, list[str]]] = []
    for file in files:
        text = file.read_text(errors="replace")
        if file.suffix == ".sources":
            entries.extend(_parse_deb822(text))
        else:
            entries.extend(_parse_one_line_style(text))
    return entries


def _parse_one_line_style(text: str) -> list[tuple[str, list[str]]]:
    entries = []
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 2:
            entries.append((words[0], [words[1]]))
    return entries


def _parse_deb822(text: str) -> list[tuple[str, list[str]]]:
    entries = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        suites = fields.get("suites", "").split()
        for uri in fields.get("uris", "").split():
            entries.append((uri, suites))
    return entries


def docker_image_id(*, image: str) -> str | None:
    import docker
    from docker.errors import ImageNotFound

    client = docker.from_env()
    try:
        return client.images.get(image).id
    except ImageNotFound:
        return None
    finally:
        client.close()


def sandbox_image_build(*, config: SandboxImageConfig, force: bool = False) -> ImageBuildResult:
    """Build (or reuse) the rootfs tarball and import it as ``config.image``.

    Skips everything when the image already exists, unless ``force``; with ``force`` the tarball is
    rebuilt too, so a changed mirror snapshot really reaches the image.
    """
    existing = docker_image_id(image=config.image)
    mirror = config.mirror or apt_mirror_for_suite(suite=config.suite)
    tarball = config.cache_dir / f"rootfs-{config.suite}-{config.fingerprint(mirror)}.tar"
    if existing and not force:
        logger.info("image %s already present (%s); use force to rebuild", config.image, existing)
        return ImageBuildResult(config.image, existing, tarball, built_rootfs=False, imported=False)
    built = False
    if force or not tarball.exists():
        _rootfs_build(config=config, mirror=mirror, tarball=tarball)
        built = True
    image_id = _rootfs_import(config=config, tarball=tarball, mirror=mirror)
    return ImageBuildResult(config.image, image_id, tarball, built_rootfs=built, imported=True)


def _run(args: list[str], *, step: str, timeout: float = 1800) -> None:
    logger.info("%s: %s", step, " ".join(args))
    proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise ImageBuildError(f"{step} failed with exit code {proc.returncode}:\n{tail}")


def _rootfs_build(*, config: SandboxImageConfig, mirror: str, tarball: Path) -> None:
    if os.geteuid() != 0:
        raise ImageBuildError("debootstrap needs root; run build_sandbox_image as root (or via sudo)")
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed; apt-get install debootstrap")
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=config.cache_dir) as scratch:
        root = Path(scratch) / "root"
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(config.packages)}",
                config.suite,
                str(root),
                mirror,
            ],
            step="debootstrap",
        )
        _run(
            ["chroot", str(root), "useradd", "--uid", str(config.agent_uid), "--create-home",
             "--shell", "/bin/bash", "agent"],
            step="create agent user",
        )
        workspace = root / config.workspace.lstrip("/")
        workspace.mkdir(parents=True, exist_ok=True)
        os.chown(workspace, config.agent_uid, config.agent_uid)
        # git refuses to work in a tree owned by another uid; the workspace is bind-mounted from the host.
        (root / "etc/gitconfig").write_text("[safe]\n\tdirectory = *\n[user]\n\tname = agent\n\temail = agent@sandbox\n")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".tar.partial")
        # Docker provides /dev itself; device nodes in an imported layer only cause permission errors.
        _run(["tar", "--numeric-owner", "--exclude=./dev/*", "-C", str(root), "-cf", str(partial), "."],
             step="pack rootfs")
        partial.replace(tarball)
    logger.info("rootfs tarball written to %s (%.1f MiB)", tarball, tarball.stat().st_size / 2**20)


def _rootfs_import(*, config: SandboxImageConfig, tarball: Path, mirror: str) -> str:

    labels = {"flowstate.sandbox-image": config.fingerprint(mirror), **config.extra_labels}
    changes = [
        f"USER {config.agent_uid}:{config.agent_uid}",
        f"WORKDIR {config.workspace}",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV HOME=/home/agent LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1",
        'CMD ["sleep", "infinity"]',
        *(f"LABEL {key}={value}" for key, value in labels.items()),
    ]
    return rootfs_tarball_import(tarball=tarball, image=config.image, changes=changes)


def rootfs_tarball_import(*, tarball: Path, image: str, changes: list[str]) -> str:
    """``docker import`` of a root filesystem tarball as ``image`` (``name:tag``) with Dockerfile
    ``changes``; returns the image id (shared by the sandbox and the application image)."""
    import docker

    repository, tag = image.rsplit(":", 1)
    client = docker.from_env()
    try:
        client.api.import_image(src=str(tarball), repository=repository, tag=tag, changes=changes)
        return client.images.get(image).id
    except docker.errors.APIError as exc:
        raise ImageBuildError(f"docker import of {tarball} failed: {exc}") from exc
    finally:
        client.close()
