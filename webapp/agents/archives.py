"""Uploaded repository archives: kept under the state directory once their members look safe.

This is the early check at submission: every member goes through the extractor's own checks
(``sandboxes.archives.inspect_archive``: names, depth, links, special files, counts, sizes), so an
archive the extractor would refuse gets a 400 on the ``archive`` field here. It is extracted later,
as an unprivileged user and member by member under a directory fd, when its snapshot is built.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile

from sandboxes.archives import ArchiveLimits, inspect_archive
from sandboxes.base import ArchiveRejected

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_ARCHIVE_MEMBERS = 20_000
MAX_ARCHIVE_UNPACKED_BYTES = 512 * 1024 * 1024


def archive_store(*, upload: UploadedFile) -> Path:
    """Validate an uploaded archive and keep it under the state dir; refuse anything unsafe."""
    name = upload.name or ""
    if not name.lower().endswith(ARCHIVE_SUFFIXES):
        raise ValidationError({"archive": f"'{name}' is not a supported archive; upload a .tar.gz, .tgz, .tar or .zip file"})
    if upload.size > settings.MAX_UPLOAD_BYTES:
        raise ValidationError({"archive": f"the archive is {upload.size} bytes; the limit is {settings.MAX_UPLOAD_BYTES} bytes"})
    target_dir = Path(settings.STATE_DIR) / "uploads"
    target_dir.mkdir(parents=True, exist_ok=True)
    suffix = next(s for s in ARCHIVE_SUFFIXES if name.lower().endswith(s))
    target = target_dir / f"{uuid.uuid4().hex}{suffix}"
    with target.open("wb") as out:
        for chunk in upload.chunks():
            out.write(chunk)
    try:
        _archive_check(target)
    except ValidationError:
        target.unlink(missing_ok=True)
        raise
    return target


def upload_archive_limits() -> ArchiveLimits:
    """What an uploaded archive may hold: tighter than what the extractor accepts from staff sources."""
    return ArchiveLimits(max_members=MAX_ARCHIVE_MEMBERS, max_total_bytes=MAX_ARCHIVE_UNPACKED_BYTES,
                         max_depth=settings.ARCHIVE_MAX_DEPTH)


def _archive_check(path: Path) -> None:
    # The extractor's own member checks, run without writing: names, depth, links (tar and zip
    # alike), writes through links, hard-link targets, special files, member count and sizes.
    try:
        inspect_archive(path, limits=upload_archive_limits(), label="the archive")
    except ArchiveRejected as exc:
        raise ValidationError({"archive": str(exc)}) from None
