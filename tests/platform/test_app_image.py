"""The application image's wheel install: the project from its own file, the wheelhouse's versions pinned,
and pip in the chroot free of the build machine's environment (webapp.core.app_image). The whole build
(debootstrap, docker import) is run by hand: see docs/DEPLOY.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes.image import ImageBuildError
from webapp.core.app_image import _chroot_pip_env, _project_wheel, _wheel_pins


def _wheelhouse(path: Path, *names: str) -> Path:
    path.mkdir()
    for name in names:
        (path / name).write_bytes(b"")
    return path


def _checkout(path: Path, version: str = "0.1.0") -> Path:
    path.mkdir()
    (path / "pyproject.toml").write_text(f'[project]\nname = "flowstate"\nversion = "{version}"\n')
    return path


def test_the_project_wheel_is_the_checkouts_own_version_not_a_newer_one_of_the_same_name(tmp_path):
    # A public package called flowstate (0.6.2) was installed into the image when pip chose by name.
    wheels = _wheelhouse(tmp_path / "wheels", "flowstate-0.6.2-py3-none-any.whl", "flowstate-0.1.0-py3-none-any.whl",
                         "redis-5.2.1-py3-none-any.whl")
    project = _project_wheel(wheels=wheels, source=_checkout(tmp_path / "src"))
    assert project == "flowstate-0.1.0-py3-none-any.whl"
    pins = _wheel_pins(wheels, project=project).splitlines()
    assert "flowstate==0.1.0" in pins and "flowstate==0.6.2" not in pins
    with pytest.raises(ImageBuildError, match="no flowstate-0.2.0 wheel"):
        _project_wheel(wheels=wheels, source=_checkout(tmp_path / "other", version="0.2.0"))


def test_every_wheelhouse_distribution_is_pinned_to_its_newest_version(tmp_path):
    wheels = _wheelhouse(tmp_path / "wheels", "flowstate-0.1.0-py3-none-any.whl", "Django-5.1.4-py3-none-any.whl",
                         "django-5.1.10-py3-none-any.whl", "typing_extensions-4.12.2-py3-none-any.whl",
                         "pydantic_core-2.27.2-cp311-cp311-manylinux_2_17_x86_64.whl")
    pins = _wheel_pins(wheels, project="flowstate-0.1.0-py3-none-any.whl").splitlines()
    # 5.1.10 > 5.1.4 as versions (not as strings); names normalised as pip compares them.
    assert pins == ["django==5.1.10", "flowstate==0.1.0", "pydantic-core==2.27.2", "typing-extensions==4.12.2"]


def test_pip_in_the_chroot_gets_a_clean_environment(monkeypatch):
    # The build machine's REQUESTS_CA_BUNDLE named a path the tree lacks, and requests prefers it over PIP_CERT.
    for name, value in {"REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt", "PIP_FIND_LINKS": "/opt/wheels",
                        "PIP_INDEX_URL": "https://index.invalid/simple", "SECRET_KEY": "not for the image"}.items():
        monkeypatch.setenv(name, value)
    env = _chroot_pip_env(with_ca=True)
    assert env[:2] == ["env", "-i"]
    assert "PIP_INDEX_URL=https://index.invalid/simple" in env
    assert not any(item.startswith(("PIP_FIND_LINKS=", "SECRET_KEY=")) for item in env)
    assert {"PIP_CERT=/tmp/build-ca.pem", "REQUESTS_CA_BUNDLE=/tmp/build-ca.pem", "SSL_CERT_FILE=/tmp/build-ca.pem"} <= set(env)
    assert not any(item.startswith("REQUESTS_CA_BUNDLE=") for item in _chroot_pip_env(with_ca=False))
