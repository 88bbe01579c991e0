"""Deterministic text helpers shared by the tools: line numbering, truncation, reverse patching."""

from __future__ import annotations

import re

DISPLAY_MAX_LINES = 200
"""Lines of a tool result shown in the UI (head and tail halves); the model gets the full text."""
DISPLAY_MAX_BYTES = 16_000
"""Bytes of a tool result shown in the UI."""

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def number_lines(lines: list[str], first_line: int) -> str:
    """``cat -n`` style numbering, one tab between number and text."""
    return "".join(f"{number:6d}\t{line}" for number, line in enumerate(lines, start=first_line))


def head_tail(text: str, *, max_lines: int = DISPLAY_MAX_LINES, max_bytes: int = DISPLAY_MAX_BYTES) -> tuple[str, bool]:
    """Keep the first and last part of ``text`` within both budgets, with a note saying what was cut."""
    encoded = text.encode("utf-8")
    lines = text.splitlines(keepends=True)
    if len(lines) <= max_lines and len(encoded) <= max_bytes:
        return text, False
    keep = max(max_lines // 2, 1)
    head, tail = lines[:keep], lines[-keep:] if len(lines) > keep else []
    budget = max_bytes // 2
    head_text = "".join(head).encode("utf-8")[:budget].decode("utf-8", "ignore")
    tail_text = "".join(tail).encode("utf-8")[-budget:].decode("utf-8", "ignore")
    cut_bytes = len(encoded) - len(head_text.encode("utf-8")) - len(tail_text.encode("utf-8"))
    cut_lines = text.count("\n") - head_text.count("\n") - tail_text.count("\n")
    if not head_text.endswith("\n"):
        head_text += "\n"
    note = f"[... {max(cut_lines, 0)} lines ({max(cut_bytes, 0)} bytes) cut from the middle ...]\n"
    return head_text + note + tail_text, True


def diff_sections(diff_text: str) -> dict[str, str]:
    """Split a git-style diff into {path: section text} using the ``diff --git a/X b/X`` headers."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in diff_text.splitlines(keepends=True):
        if line.startswith("diff --git a/"):
            path = line[len("diff --git a/") :].rstrip("\n").split(" b/", 1)[0]
            current = sections.setdefault(path, [])
        if current is not None:
            current.append(line)
    return {path: "".join(lines) for path, lines in sections.items()}


def original_from_diff(current: str, section: str) -> str | None:
    """Rebuild the snapshot version of a file from its current text and its diff section.

    Returns None when the file is new (``--- /dev/null``). Hunks cover every changed line, so
    replacing each hunk's new side with its old side yields the original exactly.
    """
    lines = section.splitlines(keepends=True)
    if any(line.startswith("--- /dev/null") for line in lines):
        return None
    new_lines = current.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    index = 0
    while index < len(lines):
        match = _HUNK.match(lines[index])
        index += 1
        if not match:
            continue
        new_start = int(match.group(3))
        new_count = int(match.group(4)) if match.group(4) is not None else 1
        begin = new_start - 1 if new_count else new_start
        out.extend(new_lines[cursor:begin])
        cursor = begin + new_count
        old_side: list[str] = []
        while index < len(lines) and not lines[index].startswith(("@@", "diff --git")):
            line = lines[index]
            if line.startswith("\\"):
                if old_side and lines[index - 1][:1] in (" ", "-"):
                    old_side[-1] = old_side[-1].rstrip("\n")
            elif line[:1] in (" ", "-"):
                old_side.append(line[1:])
            index += 1
        out.extend(old_side)
    out.extend(new_lines[cursor:])
    return "".join(out)
