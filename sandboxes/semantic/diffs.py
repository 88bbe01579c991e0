"""Read a sandbox's git-style unified diff: which files a fork changed, and their snapshot versions.

The Docker backend's snapshot is an image, not a host directory, so the base index of such a
snapshot is rebuilt from a sandbox's files with the fork's own edits undone by reversing its diff.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int
    old_length: int
    new_start: int
    new_length: int
    old_lines: list[str] = field(default_factory=list)
    old_remaining: int = 0
    new_remaining: int = 0

    def __post_init__(self) -> None:
        self.old_remaining, self.new_remaining = self.old_length, self.new_length


@dataclass
class FilePatch:
    old_path: str | None
    """Path before the change; None for an added file."""
    new_path: str | None
    """Path after the change; None for a deleted file."""
    hunks: list[Hunk] = field(default_factory=list)
    binary: bool = False


def _strip_prefix(raw: str) -> str | None:
    path = raw.rstrip("\n").split("\t", 1)[0]
    if path.startswith('"') and path.endswith('"'):
        # git quotes unusual names C-style, with octal escapes for UTF-8 bytes.
        path = codecs.escape_decode(path[1:-1].encode())[0].decode("utf-8", "replace")
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_unified_diff(text: str) -> list[FilePatch]:
    patches: list[FilePatch] = []
    current: FilePatch | None = None
    hunk: Hunk | None = None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            match = re.match(r"^diff --git a/(.*) b/(.*)$", line)
            old, new = (match.group(1), match.group(2)) if match else (None, None)
            current = FilePatch(old_path=old, new_path=new)
            patches.append(current)
            hunk = None
            continue
        if current is None:
            if line.startswith("--- "):
                current = FilePatch(old_path=None, new_path=None)
                patches.append(current)
            else:
                continue
        if hunk is not None and (hunk.old_remaining > 0 or hunk.new_remaining > 0 or line.startswith("\\")):
            _hunk_line(hunk, line)
            continue
        current, new_hunk = _header_line(current, line, patches)
        if new_hunk is not None:
            hunk = new_hunk
    return patches


def _hunk_line(hunk: Hunk, line: str) -> None:
    """One line of a hunk's body: context and removed lines are the old text; added lines only count."""
    marker, content = line[:1], line[1:]
    if marker in (" ", ""):
        hunk.old_lines.append(content)
        hunk.old_remaining -= 1
        hunk.new_remaining -= 1
    elif marker == "-":
        hunk.old_lines.append(content)
        hunk.old_remaining -= 1
    elif marker == "+":
        hunk.new_remaining -= 1


def _header_line(current: FilePatch, line: str, patches: list[FilePatch]) -> tuple[FilePatch, Hunk | None]:
    """A line outside a hunk's body: the file patch it leaves current, and the hunk it starts (or None)."""
    if line.startswith("new file mode"):
        current.old_path = None
    elif line.startswith("deleted file mode"):
        current.new_path = None
    elif line.startswith("rename from "):
        current.old_path = line[len("rename from "):]
    elif line.startswith("rename to "):
        current.new_path = line[len("rename to "):]
    elif line.startswith(("Binary files ", "GIT binary patch")):
        current.binary = True
    elif line.startswith("--- "):
        if current.hunks:
            current = FilePatch(old_path=None, new_path=None)
            patches.append(current)
        current.old_path = _strip_prefix(line[4:])
    elif line.startswith("+++ "):
        current.new_path = _strip_prefix(line[4:])
    elif (header := _HUNK_HEADER.match(line)) is not None:
        old_start, old_length, new_start, new_length = header.groups()
        hunk = Hunk(
            int(old_start), 1 if old_length is None else int(old_length),
            int(new_start), 1 if new_length is None else int(new_length),
        )
        current.hunks.append(hunk)
        return current, hunk
    return current, None


def changed_paths(patches: list[FilePatch]) -> set[str]:
    """Every path a fork added, modified, deleted or renamed (both names of a rename)."""
    paths: set[str] = set()
    for patch in patches:
        paths.update(path for path in (patch.old_path, patch.new_path) if path)
    return paths


def original_text(*, patch: FilePatch, current: str | None) -> str | None:
    """The snapshot's text of ``patch.old_path`` given the fork's current text of ``patch.new_path``.

    None when the file did not exist in the snapshot or the patch is binary (nothing to recover).
    """
    if patch.old_path is None or patch.binary:
        return None
    if patch.new_path is None:
        lines: list[str] = []
        for hunk in patch.hunks:
            lines.extend(hunk.old_lines)
        return "\n".join(lines) + "\n" if lines else ""
    if current is None:
        return None
    new_lines = current.splitlines()
    old_lines: list[str] = []
    cursor = 0
    for hunk in sorted(patch.hunks, key=lambda h: h.new_start):
        # A pure deletion (new_length 0) names the line before the gap; otherwise its first line.
        start = hunk.new_start if hunk.new_length == 0 else hunk.new_start - 1
        old_lines.extend(new_lines[cursor:start])
        old_lines.extend(hunk.old_lines)
        cursor = start + hunk.new_length
    old_lines.extend(new_lines[cursor:])
    return "\n".join(old_lines) + ("\n" if old_lines else "")
