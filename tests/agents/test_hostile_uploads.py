"""Uploaded archives are refused at submission, with a 400 naming the ``archive`` field, when the
extractor would refuse them later: too deep, links that leave the archive, writes through links.

Before, a zip's symlinks were not looked at until its snapshot was built (a tar's were), and no
depth was checked anywhere, so a 6 KB archive 1,500 directories deep reached the worker.
"""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest

from tests.sandboxes.attacks.test_deep_trees import deep_tar, deep_zip

pytestmark = pytest.mark.django_db


def _zip(members: list[tuple[str, str | None, bytes]]) -> bytes:
    """members: (name, 'link', 'fifo' or None, data); links are stored the way Info-ZIP stores them."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, kind, data in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = {"link": 0o120777, "fifo": 0o010644, None: 0o100644}[kind] << 16
            archive.writestr(info, data)
    return buffer.getvalue()


def _tar_depth(depth: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("/".join(["p"] * (depth - 1) + ["f.py"]))
        info.size = 2
        archive.addfile(info, io.BytesIO(b"x\n"))
    return buffer.getvalue()


def _post(api, name: str, data: bytes):
    upload = io.BytesIO(data)
    upload.name = name
    return api.post("/api/tasks/", {"prompt": "x", "backend": "scripted", "archive": upload}, format="multipart")


HOSTILE = {
    "deep-zip": ("repo.zip", lambda tmp: deep_zip(tmp / "d.zip").read_bytes(), "1501 path components deep"),
    "deep-tar.gz": ("repo.tar.gz", lambda tmp: deep_tar(tmp / "d.tgz").read_bytes(), "1501 path components deep"),
    "zip-absolute-link": ("repo.zip", lambda tmp: _zip([("a.py", None, b"x"), ("l", "link", b"/etc/shadow")]),
                          "points outside"),
    "zip-parent-link": ("repo.zip", lambda tmp: _zip([("l", "link", b"../../etc")]), "points outside"),
    "zip-link-chain": ("repo.zip", lambda tmp: _zip([("sub/lnk", "link", b"../"), ("sub/lnk2", "link", b"lnk/.."),
                                                     ("sub/lnk2/x/inner", None, b"owned")]), "through a symlink"),
    "zip-fifo": ("repo.zip", lambda tmp: _zip([("fifo", "fifo", b"")]), "device, fifo"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_get_a_400_naming_the_archive_field(owner, api_client_for, settings, tmp_path, case):
    settings.STATE_DIR = tmp_path
    name, build, message = HOSTILE[case]
    response = _post(api_client_for(owner), name, build(tmp_path))
    assert response.status_code == 400, response.content[:500]
    errors = response.json()
    assert list(errors) == ["archive"], errors
    assert message in errors["archive"][0], errors
    assert len(errors["archive"][0]) < 600  # the 3 KB member name is shortened, not echoed whole
    assert not any((tmp_path / "uploads").iterdir())


def test_the_depth_limit_is_a_setting(owner, api_client_for, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    settings.ARCHIVE_MAX_DEPTH = 4
    api = api_client_for(owner)
    response = _post(api, "repo.tar", _tar_depth(5))
    assert response.status_code == 400
    assert "5 path components deep; the limit is 4" in response.json()["archive"][0]
    assert _post(api, "repo.tar", _tar_depth(4)).status_code == 201


def test_safe_links_inside_a_zip_are_still_accepted(owner, api_client_for, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    data = _zip([("src/a.py", None, b"A = 1\n"), ("src/alias.py", "link", b"a.py"), ("top", "link", b"src")])
    assert _post(api_client_for(owner), "repo.zip", data).status_code == 201
