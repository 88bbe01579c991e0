"""Branches from finished tasks: commit the task's changes on ``flowstate/task-<id>``, keep a git
bundle of it, and push it to the repository's remote when the repository has push credentials.

Everything runs on the host, never in a sandbox, and as an unprivileged uid when this process is
root: the repository is materialised again from the task's source (the same code path as its
snapshot: SSRF-checked clone, safe archive extraction), the task's diff goes through ``git apply``
(which refuses ``..``, ``.git/`` and paths beyond symlinks), and no user value is ever read as a git
option: the branch name is built from the task id, files are passed after ``--``, the remote URL is
checked by ``sandboxes.git_fetch`` and pinned to the checked address.

Credentials are Fernet-encrypted in the database (``credentials_encrypt``), decrypted only for the
push and handed to git as an ``http.extraHeader`` through ``GIT_CONFIG_*`` environment variables
(never on a command line, never in the URL, never in a sandbox); push errors are summarised without
git's output.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from webapp.agents.models import AgentTask, Repository, RepositoryCredential, TaskBranch
from webapp.core.validation import CONFLICT

logger = logging.getLogger(__name__)

BRANCH_PREFIX = "flowstate/task-"
UNPRIVILEGED = (65534, 65534)
GIT_TIMEOUT_S = 300
AUTHOR = ("Flowstate agent", "agent@flowstate.invalid")


class BranchError(Exception):
    """A git step failed; the message is safe to show (no git output, no credentials)."""


# --- credentials -----------------------------------------------------------------------------

def _fernet():
    from cryptography.fernet import Fernet

    key = settings.CREDENTIALS_KEY
    if not key:
        if settings.PRODUCTION:
            raise ValidationError({"secret": "set FLOWSTATE_CREDENTIALS_KEY (a Fernet key) to store push credentials"})
        key = base64.urlsafe_b64encode(hashlib.sha256(b"flowstate-credentials:" + settings.SECRET_KEY.encode()).digest())
    try:
        return Fernet(key)
    except ValueError:
        raise ValidationError({"secret": "FLOWSTATE_CREDENTIALS_KEY is not a Fernet key (urlsafe base64 of 32 bytes)"}) \
            from None


def credentials_set(*, repository: Repository, user, secret: str, username: str = "") -> RepositoryCredential:
    """Store (replace) the push credentials of the owner's git repository; the secret is encrypted."""
    if repository.owner_id != user.pk:
        raise ValidationError({"secret": "only the repository's owner can set its push credentials"})
    if repository.kind != Repository.Kind.GIT:
        raise ValidationError({"secret": ValidationError("only git repositories have a remote to push to",
                                                         code=CONFLICT)})
    username, secret = (username or "").strip(), (secret or "").strip()
    if not secret or len(secret) > 4000 or any(ord(c) < 0x20 for c in secret + username) or len(username) > 200:
        raise ValidationError({"secret": "give a token (and a user name) without control characters"})
    credential, _ = RepositoryCredential.objects.update_or_create(
        repository=repository, defaults={"username": username or "x-access-token",
                                         "secret_encrypted": _fernet().encrypt(secret.encode())})
    return credential


def _credentials_get(repository: Repository | None) -> tuple[str, str] | None:
    credential = RepositoryCredential.objects.filter(repository=repository).first() if repository else None
    if credential is None:
        return None
    return credential.username, _fernet().decrypt(bytes(credential.secret_encrypted)).decode()


# --- git on the host -------------------------------------------------------------------------

def _run_as() -> tuple[int, int] | None:
    return UNPRIVILEGED if os.geteuid() == 0 else None


def _git(args: list[str], *, cwd: Path, home: Path, env: dict[str, str] | None = None,
         what: str) -> subprocess.CompletedProcess:
    from sandboxes.extract_server import unprivileged_prefix

    run_as = _run_as()
    prefix = unprivileged_prefix(run_as, memory_bytes=2 << 30, cpu_seconds=GIT_TIMEOUT_S) if run_as else []
    base_env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_CONFIG_GLOBAL": "/dev/null", "LANG": "C", "GIT_AUTHOR_NAME": AUTHOR[0],
                "GIT_AUTHOR_EMAIL": AUTHOR[1], "GIT_COMMITTER_NAME": AUTHOR[0], "GIT_COMMITTER_EMAIL": AUTHOR[1],
                "GIT_ALLOW_PROTOCOL": "http:https:git"}
    try:
        result = subprocess.run([*prefix, "git", "-c", "core.hooksPath=/dev/null", *args], cwd=cwd, capture_output=True,
                                text=True, env={**base_env, **(env or {})}, timeout=GIT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise BranchError(f"{what} timed out") from None
    if result.returncode != 0:
        logger.warning("%s failed (exit %s): %s", what, result.returncode, result.stderr[-2000:])
        raise BranchError(f"{what} failed (exit {result.returncode})")
    return result


def _chown_tree(root: Path, owner: tuple[int, int]) -> None:
    from sandboxes.safe_tree import chown_tree

    chown_tree(root, owner)  # iterative: the task's files may nest deeper than os.walk can recurse


def commit_message(task: AgentTask) -> str:
    """A commit message written from the task: its prompt, the agent's answer, the verification, follow-ups."""
    first_line = re.sub(r"\s+", " ", task.prompt.strip().splitlines()[0] if task.prompt.strip() else "changes")
    subject = f"Flowstate task {task.pk}: {first_line}"
    subject = subject if len(subject) <= 72 else subject[:71].rstrip() + "…"

    def block(text: str, limit: int = 1500) -> str:
        text = text.strip()
        text = text if len(text) <= limit else text[:limit] + " […]"
        return "\n".join(textwrap.fill(line, 72) if line else "" for line in text.splitlines())

    parts = [subject, "", "Task:", block(task.prompt)]
    followups = list(task.followups.filter(status="delivered").values_list("message", flat=True)[:10])
    if followups:
        parts += ["", "Follow-ups:", *(f"- {block(text, 300)}" for text in followups)]
    if task.final_message:
        parts += ["", "Agent's summary:", block(task.final_message)]
    parts += ["", f"Verification: {task.verdict}" + (f" ({task.test_summary})" if task.test_summary else "")]
    if task.test_command:
        parts.append(f"Test command: {task.test_command}")
    parts += ["", f"Flowstate-Task: {task.public_id}", f"Flowstate-Model: {task.model_name}"]
    return "\n".join(parts).replace("\x00", "\ufffd") + "\n"


def _materialize(task: AgentTask, work: Path) -> Path:
    from sandboxes.archives import ArchiveLimits
    from sandboxes.base import RepoSource, SandboxError
    from sandboxes.materialize import materialize_source

    tree = work / "tree"
    try:
        materialize_source(source=RepoSource(kind=task.repo_kind, location=task.repo_location,
                                             ref=(task.repo_ref or None) if task.repo_kind == "git" else None),
                           tree=tree, run_as=_run_as(), archive_limits=ArchiveLimits())
    except (SandboxError, OSError) as exc:
        raise BranchError(f"could not fetch the repository again: {exc}") from None
    owner = _run_as()
    if owner is not None:
        _chown_tree(tree, owner)
    return tree


def _build(task: AgentTask, work: Path, message: str) -> tuple[str, str, Path]:
    """(base commit, branch commit, bundle path) of the task's branch, built under ``work``."""
    home = work
    tree = _materialize(task, work)
    if not (tree / ".git").is_dir():
        _git(["init", "-q", "-b", "main"], cwd=tree, home=home, what="git init")
    _git(["add", "-A", "--", "."], cwd=tree, home=home, what="git add")
    if _git(["status", "--porcelain"], cwd=tree, home=home, what="git status").stdout.strip():
        # The snapshot held files no commit has (an archive, a directory's uncommitted state): commit them as the base.
        _git(["commit", "-q", "--no-verify", "-m", "The repository as Flowstate's snapshot had it"], cwd=tree,
             home=home, what="git commit of the base")
    base = _git(["rev-parse", "HEAD"], cwd=tree, home=home, what="git rev-parse").stdout.strip()
    branch = f"{BRANCH_PREFIX}{task.pk}"
    _git(["checkout", "-q", "-B", branch], cwd=tree, home=home, what="git checkout")
    (work / "task.patch").write_text(task.diff)
    (work / "message.txt").write_text(message)
    _git(["apply", "--index", "--whitespace=nowarn", "--", str(work / "task.patch")], cwd=tree, home=home,
         what="applying the task's patch")
    _git(["commit", "-q", "--no-verify", "-F", str(work / "message.txt")], cwd=tree, home=home, what="git commit")
    commit = _git(["rev-parse", "HEAD"], cwd=tree, home=home, what="git rev-parse").stdout.strip()
    _git(["bundle", "create", "-q", str(work / "branch.bundle"), branch], cwd=tree, home=home,
         what="git bundle")
    return base, commit, tree


def _push(task: AgentTask, tree: Path, home: Path, credentials: tuple[str, str]) -> str:
    """Push the branch to the task's git URL with ``credentials``; return the URL pushed to (no secret)."""
    from sandboxes.git_fetch import GitSourceRejected, resolve_target

    try:
        target = resolve_target(task.repo_location)
    except GitSourceRejected as exc:
        raise BranchError(f"not pushed: {exc}") from None
    parts = urlsplit(task.repo_location)
    shown = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")).geturl()
    if parts.username or parts.password:
        raise BranchError("not pushed: the repository URL carries credentials; register it without them")
    user, secret = credentials
    header = "Authorization: Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
    env = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.extraHeader", "GIT_CONFIG_VALUE_0": header}
    branch = f"{BRANCH_PREFIX}{task.pk}"
    # The flowstate/ namespace is ours: a branch made again after a follow-up replaces the old one.
    _git([*target.config, "push", "--quiet", "--no-verify", "--", target.url, f"+refs/heads/{branch}:refs/heads/{branch}"],
         cwd=tree, home=home, env=env, what="git push")
    return shown


def branch_create(*, task: AgentTask, user) -> TaskBranch:
    """Commit a finished task's changes on ``flowstate/task-<id>`` (again, after a follow-up), keep its
    bundle, and push it when the repository has push credentials. Owner only."""
    if task.owner_id != user.pk:
        raise ValidationError({"task": "only the task's owner can create its branch"})
    if not task.is_finished or task.source != AgentTask.Source.PRODUCT:
        raise ValidationError({"task": ValidationError("the task has not finished; create its branch when it has",
                                                       code=CONFLICT)})
    if not task.diff.strip():
        raise ValidationError({"task": ValidationError("the task changed no files: there is nothing to commit",
                                                       code=CONFLICT)})
    message = commit_message(task)
    credentials = _credentials_get(task.repository) if task.repo_kind == Repository.Kind.GIT else None
    scratch = Path(tempfile.mkdtemp(prefix="flowstate-branch-"))
    try:
        os.chmod(scratch, 0o711)
        work = scratch / "work"
        work.mkdir(mode=0o700)
        owner = _run_as()
        if owner is not None:
            os.chown(work, *owner)
        try:
            base, commit, tree = _build(task, work, message)
            pushed_to, push_error = "", ""
            if credentials is not None:
                try:
                    pushed_to = _push(task, tree, work, credentials)
                except BranchError as exc:
                    push_error = str(exc)
        except BranchError as exc:
            raise ValidationError({"task": str(exc)}) from None
        target = Path(settings.STATE_DIR) / "branches" / f"task-{task.pk}.bundle"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "branch.bundle", target)
    finally:
        from sandboxes.safe_tree import discard_tree

        discard_tree(scratch, what="branch scratch directory")
    with transaction.atomic():
        branch, _ = TaskBranch.objects.update_or_create(task=task, defaults={
            "name": f"{BRANCH_PREFIX}{task.pk}", "base_commit": base, "commit": commit, "message": message,
            "bundle_path": str(target), "diff_digest": hashlib.sha256(task.diff.encode()).hexdigest(),
            "pushed_to": pushed_to, "push_error": push_error[:1000], "created_by": user})
    return branch
