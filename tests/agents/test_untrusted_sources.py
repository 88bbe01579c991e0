"""Submissions naming code or checkpoints are validated as an attacker would abuse them (issue 42)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command

from training.agent.demo_repo import DEMO_PROMPT
from webapp.agents import services
from webapp.agents.models import Repository

pytestmark = pytest.mark.django_db


def _create(owner, **extra):
    return services.task_create(owner=owner, prompt=DEMO_PROMPT, backend="scripted", enqueue=False, **extra)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:5432/x.git", "http://localhost:6379/x.git", "http://[::1]:8000/x.git",
    "http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/x.git", "git://192.168.0.1/x.git",
    "http://0x7f000001/x.git", "ssh://git@127.0.0.1/x.git", "git@github.com:x/y.git",
    "ext::sh -c id", "file:///etc/passwd", "-uhttp://example.com/x.git",
])
def test_git_urls_to_internal_addresses_or_other_schemes_are_refused(owner, settings, url):
    settings.GIT_ALLOWED_HOSTS = []
    with pytest.raises(ValidationError) as error:
        _create(owner, git_url=url)
    assert "git_url" in error.value.message_dict


def test_allow_listed_internal_git_host_is_accepted(owner, settings):
    settings.GIT_ALLOWED_HOSTS = ["127.0.0.1"]
    task = _create(owner, git_url="http://127.0.0.1:9/x.git", git_ref="main")
    assert task.repo_location == "http://127.0.0.1:9/x.git" and task.repo_ref == "main"


@pytest.mark.parametrize("ref", ["--pathspec-from-file=/etc/passwd", "-f", "main\n--detach", "a..b", "x y"])
def test_refs_that_read_as_options_or_are_malformed_are_refused(owner, ref):
    with pytest.raises(ValidationError) as error:
        _create(owner, git_url="https://example.com/x.git", git_ref=ref)
    assert "git_ref" in error.value.message_dict
    assert "root:" not in str(error.value)
    with pytest.raises(ValidationError) as error:
        services.repository_create(owner=owner, name=f"r{len(ref)}", kind="git", location="https://example.com/x.git",
                                   ref=ref)
    assert "ref" in error.value.message_dict


def test_init_checkpoint_is_chosen_by_name_and_never_reveals_server_paths(owner, settings, tmp_path):
    from webapp.experiments import services as experiment_services

    settings.STATE_DIR = tmp_path
    settings.MODEL_CHECKPOINT = None
    messages = set()
    for value in ("/etc", "/nonexistent-dir-xyz", "/root", "../../etc", str(Path(settings.BASE_DIR) / "models")):
        with pytest.raises(ValidationError) as error:
            experiment_services.experiment_create(owner=owner, name="x", config={"init_checkpoint": value})
        messages.add(error.value.message_dict["init_checkpoint"][0])
    assert len(messages) == 1, messages  # one message whatever exists on the server
    assert "models/demo" in messages.pop()


def test_gc_sandboxes_deletes_old_unreferenced_uploads_and_keeps_used_ones(owner, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    settings.SANDBOX_BACKEND = "local"
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    stale, used, fresh = uploads / "stale.tar.gz", uploads / "used.tar.gz", uploads / "fresh.zip"
    for path in (stale, used, fresh):
        path.write_bytes(b"x")
    old = time.time() - 10 * 24 * 3600
    for path in (stale, used):
        os.utime(path, (old, old))
    Repository.objects.create(owner=owner, name="kept", kind="archive", location=str(used))
    call_command("gc_sandboxes", "--max-age-s", str(3 * 24 * 3600))
    assert not stale.exists()
    assert used.exists() and fresh.exists()


def test_a_finished_task_leaves_no_snapshot_behind(owner, demo_repository, settings):
    from sandboxes import get_backend

    snapshots = get_backend(settings.SANDBOX_BACKEND).root / "snapshots"
    before = set(snapshots.iterdir()) if snapshots.is_dir() else set()
    task = _create(owner, repository=demo_repository)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert task.status == "succeeded", task.status_reason
    assert set(snapshots.iterdir()) - before == set()
