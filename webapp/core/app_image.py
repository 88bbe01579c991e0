"""Offline build of the application image that compose.yaml runs (web, workers, Ray nodes, database).

Built the way the sandbox image is (``sandboxes.image``): no container registry is reachable, so
debootstrap writes a Debian root filesystem from the mirror in the machine's apt sources, the
Python dependencies come as wheels from pip's own configured index or cache (``pip wheel``, run on
the build machine) and are installed from that wheelhouse into a virtual environment inside the
root filesystem (offline; an index is asked only for what the image's python3 needs beyond it, with
every wheelhouse version pinned), the project's files are copied in, and ``docker import`` makes the image. The
Debian packages add PostgreSQL and Redis servers, so the compose file needs no image from a
registry either (one image, several commands).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sandboxes.image import (
    ImageBuildError,
    _run,
    apt_mirror_for_suite,
    docker_image_id,
    rootfs_tarball_import,
)

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
APP_DIR = "/opt/flowstate/app"
VENV_DIR = "/opt/flowstate/venv"
APP_PACKAGES: tuple[str, ...] = (
    "python3", "python3-venv", "git", "ca-certificates", "util-linux", "tini", "curl",
    "postgresql", "redis-server",
)


@dataclass(frozen=True)
class AppImageConfig:
    """What goes into the application image and where its build keeps its caches."""

    image: str = "flowstate-app:latest"
    """Docker reference to create, ``repository:tag``."""
    cache_dir: Path = field(default_factory=lambda: ROOT / "var" / "cache" / "app-image")
    """Keeps the wheelhouse and the base root filesystem between builds."""
    suite: str = "bookworm"
    """Debian release; its python3 must be the minor version the wheels are built for (3.11)."""
    packages: tuple[str, ...] = APP_PACKAGES
    """Debian packages of the base root filesystem."""
    app_uid: int = 1000
    """Numeric id of the unprivileged ``flowstate`` user the processes run as."""
    mirror: str | None = None
    """Debian mirror URL; ``None`` reads it from the machine's apt sources (never hard-coded)."""
    source: Path = ROOT
    """Project checkout to install (its tracked files, plus the built ``static/vendor``)."""

    def __post_init__(self) -> None:
        if ":" not in self.image.rsplit("/", 1)[-1]:
            raise ValueError(f"image={self.image!r} needs an explicit tag, e.g. {self.image}:latest")
        if not 1 <= self.app_uid < 65534:
            raise ValueError(f"app_uid={self.app_uid} must be an ordinary user id (1..65533), not root")
        if sys.version_info[:2] != (3, 11):
            raise ValueError("build the image with Python 3.11: the wheels must match the image's python3")

    def base_fingerprint(self, mirror: str) -> str:
        payload = json.dumps({"suite": self.suite, "packages": sorted(self.packages), "uid": self.app_uid,
                              "mirror": mirror, "layout": 1}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def app_image_build(*, config: AppImageConfig, force: bool = False) -> str:
    """Build (or keep) ``config.image``; returns its image id. Base rootfs and wheels are cached."""
    existing = docker_image_id(image=config.image)
    if existing and not force:
        logger.info("image %s already present (%s); use force to rebuild", config.image, existing)
        return existing
    if os.geteuid() != 0:
        raise ImageBuildError("debootstrap and chroot need root; run build_app_image as root (or via sudo)")
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed; apt-get install debootstrap")
    mirror = config.mirror or apt_mirror_for_suite(suite=config.suite)
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    base = config.cache_dir / f"base-{config.suite}-{config.base_fingerprint(mirror)}.tar"
    if force or not base.exists():
        _base_build(config=config, mirror=mirror, tarball=base)
    wheels = _wheelhouse(config=config)
    with tempfile.TemporaryDirectory(prefix="app-rootfs-", dir=config.cache_dir) as scratch:
        root = Path(scratch) / "root"
        root.mkdir()
        _run(["tar", "--numeric-owner", "-xf", str(base), "-C", str(root)], step="unpack base rootfs")
        _install(config=config, root=root, wheels=wheels)
        tarball = Path(scratch) / "app.tar"
        _run(["tar", "--numeric-owner", "--exclude=./dev/*", "-C", str(root), "-cf", str(tarball), "."],
             step="pack rootfs")
        return _import(config=config, tarball=tarball)


def _base_build(*, config: AppImageConfig, mirror: str, tarball: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="app-base-", dir=config.cache_dir) as scratch:
        root = Path(scratch) / "root"
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(config.packages)}", config.suite,
              str(root), mirror], step="debootstrap")
        _run(["chroot", str(root), "useradd", "--uid", str(config.app_uid), "--create-home", "--shell",
              "/bin/bash", "flowstate"], step="create flowstate user")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".tar.partial")
        _run(["tar", "--numeric-owner", "--exclude=./dev/*", "-C", str(root), "-cf", str(partial), "."],
             step="pack base rootfs")
        partial.replace(tarball)


def _wheelhouse(*, config: AppImageConfig) -> Path:
    """Wheels of the project and every dependency, from pip's configured index or its cache."""
    wheels = config.cache_dir / "wheels"
    wheels.mkdir(exist_ok=True)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), str(config.source)],
         step="pip wheel", timeout=3600)
    return wheels


def _tracked_files(source: Path) -> list[str]:
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z"], capture_output=True, check=True)
    return [name for name in listed.stdout.decode().split("\0") if name]


def _install(*, config: AppImageConfig, root: Path, wheels: Path) -> None:
    app = root / APP_DIR.lstrip("/")
    for name in _tracked_files(config.source):
        target = app / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (config.source / name).is_file():
            shutil.copy2(config.source / name, target)
    vendor = config.source / "static" / "vendor"
    if vendor.is_dir():  # built by `make static` (npm); the web process serves or collects it
        shutil.copytree(vendor, app / "static" / "vendor", dirs_exist_ok=True)
    inside = root / "tmp" / "wheels"
    shutil.copytree(wheels, inside)
    _run(["chroot", str(root), "python3", "-m", "venv", VENV_DIR], step="create venv")
    _venv_install(root=root, project=_project_wheel(wheels=wheels, source=config.source))
    shutil.rmtree(inside)
    state = root / "var" / "lib" / "flowstate"
    state.mkdir(parents=True, exist_ok=True)
    os.chown(state, config.app_uid, config.app_uid)


def _project_wheel(*, wheels: Path, source: Path) -> str:
    """File name of the checkout's own wheel in the wheelhouse (name and version from its pyproject)."""
    import tomllib

    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    name = re.sub(r"[-_.]+", "_", project["name"]).lower()
    found = sorted(wheels.glob(f"{name}-{project['version']}-*.whl"))
    if not found:
        raise ImageBuildError(f"pip wheel left no {name}-{project['version']} wheel in {wheels}")
    return found[-1].name


def _wheel_pins(wheels: Path, *, project: str) -> str:
    """``name==version`` for every distribution in the wheelhouse (the newest, if it holds several;
    the project's own version from its wheel ``project``, whatever else the wheelhouse holds)."""
    newest: dict[str, str] = {}
    for wheel in [*sorted(wheels.glob("*.whl")), Path(project)]:
        name, version = wheel.name.split("-")[:2]
        key = re.sub(r"[-_.]+", "-", name).lower()
        if wheel.name == project or key not in newest or _version_key(version) > _version_key(newest[key]):
            newest[key] = version
    return "".join(f"{name}=={version}\n" for name, version in sorted(newest.items()))


def _version_key(version: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(version))
    except InvalidVersion:
        return (0, version)


def _venv_install(*, root: Path, project: str) -> None:
    """Install the project's wheel and its dependencies into the image's venv from ``/tmp/wheels``.

    Offline first (``--no-index``). The wheels were resolved by the build machine's Python, and the
    image's python3 can be an older patch release whose environment markers want a dependency more
    (bookworm's 3.11.2 needs async-timeout for redis, 3.11.7 does not). Only then is an index asked
    (the build machine's pip configuration, copied in for this step), for what the wheelhouse lacks:
    every wheel in it is pinned by a constraints file and the project comes from its file, so the
    index cannot replace one of them. (Installed by name, ``flowstate`` came from the public index:
    an unrelated package of that name, 0.6.2, was newer than the project's 0.1.0.)
    """
    pip = ["chroot", str(root), f"{VENV_DIR}/bin/pip", "install", "--quiet", "--find-links", "/tmp/wheels"]
    try:
        _run([*_chroot_pip_env(with_ca=False), *pip, "--no-index", f"/tmp/wheels/{project}"],
             step="install wheels (offline)", timeout=3600)
        return
    except ImageBuildError as exc:
        logger.warning("the wheelhouse lacks a dependency of the image's python3; asking the index for it: %s",
                       str(exc)[-500:])
    (root / "tmp" / "wheel-pins.txt").write_text(_wheel_pins(root / "tmp" / "wheels", project=project))
    copied = [target for source, target in (("/etc/pip.conf", root / "etc" / "pip.conf"),
                                            ("/etc/xdg/pip", root / "etc" / "xdg" / "pip"))
              if Path(source).exists() and not target.exists()]
    for target in copied:  # pip.conf and the files it names (constraints); removed again below
        source = Path("/") / target.relative_to(root)
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
    build_ca = _build_machine_ca_bundle()
    if build_ca is not None:
        shutil.copy2(build_ca, root / "tmp" / "build-ca.pem")
    try:
        _run([*_chroot_pip_env(with_ca=build_ca is not None), *pip, "--constraint", "/tmp/wheel-pins.txt",
              f"/tmp/wheels/{project}"], step="install wheels (index for what the wheelhouse lacks)", timeout=3600)
    finally:
        (root / "tmp" / "build-ca.pem").unlink(missing_ok=True)
        (root / "tmp" / "wheel-pins.txt").unlink(missing_ok=True)
        for target in copied:
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()


PIP_PASSED_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT",
                  "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


def _chroot_pip_env(*, with_ca: bool) -> list[str]:
    """``env -i ...`` for pip in the chroot: a clean environment, not the build machine's, whose paths
    (``PIP_FIND_LINKS``, ``REQUESTS_CA_BUNDLE`` …) do not exist in the tree (requests prefers
    ``REQUESTS_CA_BUNDLE`` over ``PIP_CERT``, so an inherited one made every download fail). Only the
    index and proxy settings pass, and, with ``with_ca``, the build machine's CA bundle for this step
    (its index may sit behind a proxy CA the image's Debian bundle lacks)."""
    env = ["env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
           "LANG=C.UTF-8", "PIP_NO_INPUT=1", "PIP_RETRIES=2", "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    env += [f"{name}={os.environ[name]}" for name in PIP_PASSED_ENV if os.environ.get(name)]
    if with_ca:
        env += [f"{name}=/tmp/build-ca.pem" for name in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")]
    return env


def _build_machine_ca_bundle() -> Path | None:
    """The CA bundle pip trusts on the build machine (``PIP_CERT``, else the system's), if it has one."""
    import ssl

    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().cafile,
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _import(*, config: AppImageConfig, tarball: Path) -> str:

    changes = [
        f"WORKDIR {APP_DIR}",
        f"ENV PATH={VENV_DIR}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8 PYTHONUNBUFFERED=1 DJANGO_SETTINGS_MODULE=webapp.settings "
        "FLOWSTATE_STATE_DIR=/var/lib/flowstate OMP_NUM_THREADS=1",
        f"USER {config.app_uid}:{config.app_uid}",
        'ENTRYPOINT ["/usr/bin/tini", "--"]',
        'CMD ["python", "-m", "uvicorn", "webapp.asgi:application", "--host", "0.0.0.0", "--port", "8000", '
        '"--ws-per-message-deflate", "false"]',
        "LABEL flowstate.app-image=1",
    ]
    return rootfs_tarball_import(tarball=tarball, image=config.image, changes=changes)
