"""Uploaded repository archives: kept under the state directory once their members look safe.

This is the early, cheap check at submission (names, links, sizes, member count); the archive is
extracted later, as an unprivileged user and member by member under a directory fd, by
``sandboxes.archives`` when its snapshot is built.
"""

from __future__ import annotations

import re
import tarfile
import uuid
import zipfile
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile

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


def _member_problem(member_name: str) -> str | None:
    if member_name.startswith("/") or re.match(r"^[A-Za-z]:", member_name):
        return f"member '{member_name}' has an absolute path"
    if ".." in Path(member_name).parts:
        return f"member '{member_name}' escapes the archive with '..'"
    return None


def _archive_check(path: Path) -> None:
    total = 0
    try:
        if path.name.endswith(".zip"):
            with zipfile.ZipFile(path) as archive:
                members = archive.infolist()
                if len(members) > MAX_ARCHIVE_MEMBERS:
                    raise ValidationError({"archive": f"the archive has {len(members)} members; the limit is {MAX_ARCHIVE_MEMBERS}"})
                for info in members:
                    if problem := _member_problem(info.filename):
                        raise ValidationError({"archive": problem})
                    total += info.file_size
        else:
            with tarfile.open(path) as archive:
                for count, member in enumerate(archive, start=1):
                    if count > MAX_ARCHIVE_MEMBERS:
                        raise ValidationError({"archive": f"the archive has more than {MAX_ARCHIVE_MEMBERS} members"})
                    if problem := _member_problem(member.name):
                        raise ValidationError({"archive": problem})
                    if member.issym() or member.islnk():
                        target = member.linkname
                        if target.startswith("/") or ".." in Path(target).parts:
                            raise ValidationError({"archive": f"link '{member.name}' points outside the archive ({target})"})
                    elif not (member.isfile() or member.isdir()):
                        raise ValidationError({"archive": f"member '{member.name}' is a device or fifo, which is not allowed"})
                    total += member.size
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise ValidationError({"archive": f"the archive is malformed or truncated and cannot be read ({exc})"}) from exc
    if total > MAX_ARCHIVE_UNPACKED_BYTES:
        raise ValidationError({"archive": f"the archive unpacks to {total} bytes; the limit is {MAX_ARCHIVE_UNPACKED_BYTES} bytes"})
