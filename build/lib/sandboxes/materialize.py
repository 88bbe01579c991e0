"""Turning a RepoSource into a snapshot tree on the host: one code path for every backend.

Server directories are copied (they are trusted: only staff and the demo register them); git
sources go through ``git_fetch`` and archives through ``archives``, both run as ``run_as`` (the
unprivileged uid that will own the tree) when this process is root.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from sandboxes.archives import ArchiveLimits, extract_archive
from sandboxes.base import RepoSource, SnapshotError
from sandboxes.git_fetch import git_materialize


def materialize_source(*, source: RepoSource, tree: Path, run_as: tuple[int, int] | None,
                       archive_limits: ArchiveLimits) -> None:
    """Create ``tree`` holding the files of ``source``; raises SnapshotError/ArchiveRejected."""
    if source.kind == "path":
        origin = Path(source.location)
        if not origin.is_dir():
            raise SnapshotError(f"snapshot source path {origin} is not a directory")
        tree.mkdir()
        result = subprocess.run(["cp", "-a", "--", f"{origin}/.", str(tree)], capture_output=True, text=True,
                                check=False)
        if result.returncode != 0:
            raise SnapshotError(f"copying {origin} failed: {result.stderr.strip()[-500:]}")
    elif source.kind == "git":
        git_materialize(location=source.location, ref=source.ref, tree=tree, run_as=run_as)
    else:
        extract_archive(Path(source.location), tree, limits=archive_limits, run_as=run_as)
