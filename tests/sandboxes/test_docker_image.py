"""The sandbox image build: mirror discovery from apt sources, and the cached build against the real engine."""

from pathlib import Path

import pytest

from sandboxes.image import ImageBuildError, SandboxImageConfig, apt_mirror_for_suite


def test_mirror_comes_from_deb822_and_one_line_sources(tmp_path: Path):
    listdir = tmp_path / "sources.list.d"
    listdir.mkdir()
    (listdir / "security.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\nComponents: main\n"
    )
    (listdir / "main.sources").write_text(
        "Types: deb-src\nURIs: http://src.invalid/debian\nSuites: bookworm\n\n"
        "# comment\nTypes: deb\nURIs: http://mirror.invalid/debian/\nSuites: bookworm bookworm-updates\n"
    )
    legacy = tmp_path / "sources.list"
    legacy.write_text("# deb http://commented.invalid/debian bookworm main\ndeb [arch=amd64] http://old.invalid/debian trixie main\n")
    sources = (legacy, listdir)
    assert apt_mirror_for_suite(suite="bookworm", source_paths=sources) == "http://mirror.invalid/debian"
    assert apt_mirror_for_suite(suite="trixie", source_paths=sources) == "http://old.invalid/debian"
    with pytest.raises(ImageBuildError, match="no 'deb' apt source for suite 'sid'"):
        apt_mirror_for_suite(suite="sid", source_paths=sources)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image": "flowstate-sandbox"}, "explicit tag"),
        ({"image": "x:1", "workspace": "relative"}, "absolute directory"),
        ({"image": "x:1", "agent_uid": 0}, "not root"),
        ({"image": "x:1", "packages": ()}, "packages is empty"),
    ],
)
def test_config_rejects_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxImageConfig(cache_dir=tmp_path, **kwargs)


def test_fingerprint_changes_with_inputs(tmp_path):
    base = SandboxImageConfig(image="x:1", cache_dir=tmp_path)
    more = SandboxImageConfig(image="x:1", cache_dir=tmp_path, packages=(*base.packages, "make"))
    assert base.fingerprint("http://m") == SandboxImageConfig(image="y:2", cache_dir=tmp_path).fingerprint("http://m")
    assert base.fingerprint("http://m") != more.fingerprint("http://m")
    assert base.fingerprint("http://m") != base.fingerprint("http://other")


@pytest.mark.docker
def test_built_image_has_the_agent_toolchain_and_rebuild_is_skipped(settings):
    import docker

    from sandboxes.image import docker_image_id, sandbox_image_build

    if docker_image_id(image=settings.SANDBOX_IMAGE) is None:
        pytest.skip(f"{settings.SANDBOX_IMAGE} not built; run `manage.py build_sandbox_image`")
    config = SandboxImageConfig(image=settings.SANDBOX_IMAGE, cache_dir=settings.STATE_DIR / "cache" / "sandbox-image")
    result = sandbox_image_build(config=config)
    assert result.imported is False and result.built_rootfs is False
    client = docker.from_env()
    output = client.containers.run(
        settings.SANDBOX_IMAGE,
        ["sh", "-c", "id -u; pwd; python3 -m pytest --version; git --version; rg --version; python3 -m pyflakes --version"],
        remove=True, network_mode="none", read_only=True, cap_drop=["ALL"],
    ).decode()
    lines = output.splitlines()
    assert lines[0] == "1000" and lines[1] == "/workspace"
    assert "git version" in output and "ripgrep" in output and "pyflakes" not in lines[0]


@pytest.mark.docker
@pytest.mark.django_db
def test_build_command_skips_an_existing_image_and_reports_bad_input(settings):
    from io import StringIO

    from django.core.management import CommandError, call_command

    from sandboxes.image import docker_image_id

    if docker_image_id(image=settings.SANDBOX_IMAGE) is None:
        pytest.skip(f"{settings.SANDBOX_IMAGE} not built; run `manage.py build_sandbox_image`")
    out = StringIO()
    call_command("build_sandbox_image", stdout=out, verbosity=0)
    assert "already present, skipped" in out.getvalue()
    with pytest.raises(CommandError, match="explicit tag"):
        call_command("build_sandbox_image", image="no-tag-given", verbosity=0)
