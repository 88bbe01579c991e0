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
    """Keep the first and last part of ``text`` within both budgets, with a note saying what was cut.

    Lines are found with ``str.find``/``rfind`` from either end, never by splitting the whole text: a
    16 MiB terminal output of 2-byte lines would otherwise become 8 million line objects on the host."""
    newlines = text.count("\n")
    line_count = newlines + (0 if not text or text.endswith("\n") else 1)
    if line_count <= max_lines and len(text) <= max_bytes and len(text.encode("utf-8")) <= max_bytes:
        return text, False
    keep = max(max_lines // 2, 1)
    head_end = 0
    for _ in range(keep):
        found = text.find("\n", head_end, head_end + max_bytes + 1)
        if found == -1:
            head_end = min(len(text), head_end + max_bytes)
            break
        head_end = found + 1
    tail_start = len(text)
    if line_count > keep:
        end = len(text) - 1 if text.endswith("\n") else len(text)
        for _ in range(keep):
            found = text.rfind("\n", max(0, end - max_bytes - 1), end)
            if found == -1:
                tail_start = max(0, end - max_bytes)
                break
            tail_start, end = found + 1, found
    budget = max_bytes // 2
    head_text = text[: min(head_end, budget)].encode("utf-8")[:budget].decode("utf-8", "ignore")
    tail_text = text[max(tail_start, len(text) - budget):].encode("utf-8")[-budget:].decode("utf-8", "ignore") \
        if tail_start < len(text) else ""
    total_bytes = len(text) if text.isascii() else len(text.encode("utf-8"))
    cut_bytes = total_bytes - len(head_text.encode("utf-8")) - len(tail_text.encode("utf-8"))
    cut_lines = newlines - head_text.count("\n") - tail_text.count("\n")
    if not head_text.endswith("\n"):
        head_text += "\n"
    note = f"[... {max(cut_lines, 0)} lines ({max(cut_bytes, 0)} bytes) cut from the middle ...]\n"
    return head_text + note + tail_text, True


def diff_sections(diff_text: str) -> dict[str, str]:
    """Split a git-style diff into {path: section text} using the ``diff --git a/X b/X`` headers.

    Sections are slices between header positions (no list of every line: a diff may hold millions)."""
    header = "diff --git a/"
    starts = [match.start() for match in re.finditer(r"^diff --git a/", diff_text, re.MULTILINE)]
    sections: dict[str, str] = {}
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else len(diff_text)
        line_end = diff_text.find("\n", start, end)
        path = diff_text[start + len(header): end if line_end == -1 else line_end].split(" b/", 1)[0]
        sections[path] = sections.get(path, "") + diff_text[start:end]
    return sections


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
