"""Git sources are handled as hostile: no value becomes an option, no internal address is fetched.

A repository is served over HTTP on 127.0.0.1 (git's dumb protocol, a plain Python file server),
the way an attacker would point the worker at an internal service; refs and URLs are built to be
read as options or to reach other schemes.
"""

from __future__ import annotations

import functools
import http.server
import secrets
import subprocess
import threading
from pathlib import Path

import pytest

from sandboxes.base import RepoSource, SnapshotError
from sandboxes.git_fetch import GitSourceRejected, check_ref, check_url
from tests.sandboxes.conftest import TEST_LIMITS

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]


def _bare_repo(root: Path) -> Path:
    work = root / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    (work / "hello.txt").write_text("served over loopback\n")
    subprocess.run([*GIT, "-C", str(work), "add", "."], check=True)
    subprocess.run([*GIT, "-C", str(work), "commit", "-qm", "one"], check=True)
    bare = root / "srv" / "repo.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True)
    return bare


class _Server:
    """A loopback HTTP server counting requests; ``redirect_to`` makes every answer a 302 there."""

    def __init__(self, directory: Path, redirect_to: str = "") -> None:
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):  # http.server's naming
                server.requests.append(self.path)
                if redirect_to:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                    self.end_headers()
                    return
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served_repo(tmp_path):
    bare = _bare_repo(tmp_path)
    server = _Server(bare.parent)
    yield server, f"http://127.0.0.1:{server.port}/repo.git"
    server.close()


def test_loopback_git_url_is_refused_by_default_without_a_connection(sandbox_backend, served_repo, monkeypatch):
    monkeypatch.delenv("FLOWSTATE_GIT_ALLOWED_HOSTS", raising=False)
    server, url = served_repo
    for location in (url, url.replace("127.0.0.1", "localhost"), url.replace("127.0.0.1", "[::ffff:127.0.0.1]"),
                     url.replace("127.0.0.1", "2130706433"), url.replace("127.0.0.1", "0.0.0.0")):
        with pytest.raises(GitSourceRejected, match="internal address|could not be resolved"):
            sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=location))
    assert server.requests == []


def test_loopback_git_url_is_cloned_when_allow_listed(sandbox_backend, served_repo, monkeypatch):
    monkeypatch.setenv("FLOWSTATE_GIT_ALLOWED_HOSTS", "127.0.0.1")
    server, url = served_repo
    snapshot = sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=url, ref="main"))
    with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
        assert box.read_bytes("hello.txt") == b"served over loopback\n"
    assert server.requests, "the allow-listed server was never contacted"
    sandbox_backend.snapshot_delete(snapshot=snapshot)


def test_redirect_from_an_allowed_host_to_an_internal_one_is_not_followed(sandbox_backend, served_repo, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("FLOWSTATE_GIT_ALLOWED_HOSTS", "127.0.0.1")
    internal, internal_url = served_repo
    front = _Server(tmp_path, redirect_to=f"http://localhost:{internal.port}")
    try:
        with pytest.raises(SnapshotError, match="git clone of .* failed"):
            sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=f"http://127.0.0.1:{front.port}/repo.git"))
        assert front.requests
        assert internal.requests == []
    finally:
        front.close()


def test_ref_read_as_an_option_never_leaks_a_host_file(sandbox_backend, served_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWSTATE_GIT_ALLOWED_HOSTS", "127.0.0.1")
    _, url = served_repo
    secret = f"TOPSECRET-{secrets.token_hex(6)}"
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret + "\n")
    for ref in (f"--pathspec-from-file={host_file}", "-f", "--orphan=x", "main --", "main\n--detach"):
        with pytest.raises(SnapshotError) as caught:
            sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=url, ref=ref))
        assert secret not in str(caught.value)
    # A ref that is well-formed but missing is summarised, not git's raw stderr.
    with pytest.raises(SnapshotError, match="no such branch, tag or commit") as caught:
        sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=url, ref="nope"))
    assert "pathspec" not in str(caught.value) and "error:" not in str(caught.value)


@pytest.mark.parametrize("url", [
    "ext::sh -c touch% /tmp/pwned", "file:///etc", "-uhttp://example.com/x.git", "ssh://git@127.0.0.1/x.git",
    "git@127.0.0.1:x.git", "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.git",
    "http://[fe80::1]/x.git", "http://[::1]:5432/x", "git://127.0.0.1:6379/x", "https:///nohost",
    "http://127.0.0.1:99999/x",
])
def test_bad_urls_are_rejected_before_any_command_runs(url, monkeypatch):
    monkeypatch.delenv("FLOWSTATE_GIT_ALLOWED_HOSTS", raising=False)
    with pytest.raises(GitSourceRejected):
        check_url(url, hosts_allowed=frozenset())
    assert not Path("/tmp/pwned").exists()


def test_ref_validation():
    for bad in ("-x", "--output=/tmp/x", "a..b", "a b", "refs/heads/x.lock", "x\x00", "@{-1}", "a~1^", ""):
        if bad:
            with pytest.raises(GitSourceRejected):
                check_ref(bad)
    for good in ("main", "v1.2.3", "feature/x-y", "refs/tags/v1", "0123abcd" * 5):
        assert check_ref(good) == good
