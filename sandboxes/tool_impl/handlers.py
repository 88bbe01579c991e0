"""One function per agent tool: validated arguments in, deterministic text out.

Handlers raise ``ToolFailure`` (or a ``SandboxError``) for anything the agent did wrong; the
dispatcher in ``sandboxes.tools`` turns those into error results with the message as output.
"""

from __future__ import annotations

import difflib
import shlex
import threading
from dataclasses import dataclass, field
from typing import Any

from sandboxes.base import Sandbox, SandboxError
from sandboxes.safe_fs import normalize_relative
from sandboxes.tool_impl.lines import count_lines, line_offset, line_slice
from sandboxes.tool_impl.lints import LintUnavailable, introduced_diagnostics
from sandboxes.tool_impl.text import diff_sections, head_tail, number_lines, original_from_diff

READ_FILE_MAX_LINES = 2000
"""Most lines one read_file call returns; the result says how to read the rest."""
READ_FILE_MAX_BYTES = 512 * 1024
"""Most bytes of file text one read_file call returns (fewer lines when they are long)."""
LINT_MAX_FILE_BYTES = 256 * 1024
"""read_lints skips larger Python files (with a note): ruff's diagnostics on them can dwarf the file."""
LINT_MAX_DIAGNOSTICS = 200
"""Most diagnostics read_lints returns; the count of the rest is given."""
GREP_MAX_RESULTS = 500
"""Upper bound on grep's max_results argument."""
GREP_MAX_COLUMNS = 300
"""Longer matching lines are shortened by ripgrep to a preview."""
EDIT_MAX_FILE_BYTES = 8 * 1024 * 1024
"""edit_file and replace_lines refuse larger files (checked by size, before reading them)."""
EDIT_HINT_MIN_SIMILARITY = 0.6
"""How close (difflib ratio) the file's most similar lines must be to a missed old_str to be shown."""
EDIT_HINT_MAX_LINES = 12
"""A missed old_str longer than this many lines gets no closest-text hint."""
EDIT_HINT_MAX_CHARS = 2000
"""A missed old_str longer than this many characters gets no hint: the search runs on the host, per window."""
EDIT_HINT_MAX_FILE_BYTES = 256 * 1024
"""Larger files are not searched for the closest text, so a hint costs milliseconds, never seconds."""


class ToolFailure(Exception):
    """The agent's call cannot be carried out; the message tells it why and what to do instead."""


@dataclass
class Outcome:
    """What a handler produced: the full text, whether the call succeeded, extra metadata."""

    output: str
    ok: bool = True
    meta: dict[str, Any] = field(default_factory=dict)


def _decode_text(data: bytes, path: str) -> str:
    if b"\x00" in data[:8192]:
        raise ToolFailure(f"{path} is a binary file ({len(data)} bytes); read_file only shows text")
    return data.decode("utf-8", "replace")


def read_file(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    # Works on bytes and decodes only the lines returned: host memory is the file's bytes plus the
    # (capped) result, never one object per line.
    path = normalize_relative(args["path"])
    data = sandbox.read_bytes(path)
    if b"\x00" in data[:8192]:
        raise ToolFailure(f"{path} is a binary file ({len(data)} bytes); read_file only shows text")
    total = count_lines(data)
    start = args.get("start_line", 1)
    end = args.get("end_line", total)
    if start > max(total, 1):
        raise ToolFailure(f"start_line {start} is past the end of {path}, which has {total} lines")
    if end < start:
        raise ToolFailure(f"end_line {end} is before start_line {start}")
    end = min(end, total, start + READ_FILE_MAX_LINES - 1)
    chunk = line_slice(data, start, end) if total else b""
    del data
    if len(chunk) > READ_FILE_MAX_BYTES:
        cut = chunk.rfind(b"\n", 0, READ_FILE_MAX_BYTES) + 1
        if cut > 0:
            end = start + chunk.count(b"\n", 0, cut) - 1
            chunk = chunk[:cut]
    lines = chunk.decode("utf-8", "replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    clipped = len(chunk) > READ_FILE_MAX_BYTES
    if clipped:
        end = start
        lines = [lines[0][: READ_FILE_MAX_BYTES // 4] + f" [line cut at {READ_FILE_MAX_BYTES // 4} characters]"]
    body = number_lines([line + "\n" for line in lines], start) if total else ""
    header = f"{path} (lines {start}-{end} of {total})\n" if total else f"{path} (empty file)\n"
    footer = ""
    if end < min(args.get("end_line", total), total):
        footer = f"[{total - end} more lines; call read_file with start_line={end + 1} to continue]\n"
    return Outcome(header + body + footer, meta={"path": path, "total_lines": total, "start_line": start,
                                                   "end_line": end})


def list_dir(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    path = normalize_relative(args.get("path", "."))
    entries = sandbox.list_dir(path)
    shown = path or "."
    if not entries:
        return Outcome(f"{shown}/ is empty\n", meta={"path": path, "entries": 0})
    rows = []
    for entry in entries:
        if entry.kind == "dir":
            rows.append(f"{entry.name}/")
        elif entry.kind == "symlink":
            rows.append(f"{entry.name}@")
        elif entry.kind == "file":
            rows.append(f"{entry.name} ({entry.size} bytes)")
        else:
            rows.append(f"{entry.name} (special file)")
    return Outcome(f"{shown}/\n" + "".join(f"  {row}\n" for row in rows), meta={"path": path, "entries": len(rows)})


def _read_editable(sandbox: Sandbox, path: str, tool: str) -> bytes:
    """The file's bytes for an edit, refused with a clear message past EDIT_MAX_FILE_BYTES: checked by the
    directory entry's size before reading (a symlink, or a file growing meanwhile, is refused after reading,
    bounded by the 64 MiB read limit), so an edit holds at most a few times that limit in host memory."""
    parent, _, name = path.rpartition("/")
    try:
        size = next((entry.size for entry in sandbox.list_dir(parent) if entry.name == name), 0)
    except SandboxError:
        size = 0  # read_bytes below names the problem (no such file, a directory, outside the workspace)
    data = b"" if size > EDIT_MAX_FILE_BYTES else sandbox.read_bytes(path)
    if size > EDIT_MAX_FILE_BYTES or len(data) > EDIT_MAX_FILE_BYTES:
        raise ToolFailure(
            f"{path} is {max(size, len(data))} bytes, over {tool}'s {EDIT_MAX_FILE_BYTES // (1024 * 1024)} MiB "
            "limit; change it with run_terminal instead (e.g. sed -i, or a python3 script run in the sandbox)"
        )
    _decode_text(data[:8192], path)
    return data


def edit_file(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    # Bytes in, bytes out: old_str is searched as UTF-8 bytes, bytes outside the match are written back
    # untouched, and the whole file is never decoded (only a small file is, for a missed match's hint).
    path = normalize_relative(args["path"])
    old, new = args["old_str"], args["new_str"]
    if old == "":
        raise ToolFailure("old_str is empty; give the exact text to replace (use create_file for new files)")
    if old == new:
        raise ToolFailure("old_str and new_str are identical; nothing would change")
    data = _read_editable(sandbox, path, "edit_file")
    needle = old.encode("utf-8")
    positions: list[int] = []
    start = data.find(needle)
    while start != -1 and len(positions) < 21:
        positions.append(start)
        start = data.find(needle, start + 1)
    if not positions:
        hint = _closest_text_hint(data.decode("utf-8", "replace"), old, path) \
            if len(data) <= EDIT_HINT_MAX_FILE_BYTES else "Read the file again and copy the text exactly."
        raise ToolFailure(
            f"old_str was found 0 times in {path}; it must match the file exactly once, including "
            "whitespace and indentation. " + hint
        )
    if len(positions) > 1:
        total = str(len(positions)) if len(positions) <= 20 else "more than 20"
        lines = ", ".join(str(data.count(b"\n", 0, p) + 1) for p in positions[:20])
        raise ToolFailure(
            f"old_str was found {total} times in {path} (starting at lines {lines}); "
            "include more surrounding lines so it matches exactly once"
        )
    at = positions[0]
    line = data.count(b"\n", 0, at) + 1
    updated = data[:at] + new.encode("utf-8") + data[at + len(needle):]
    del data
    sandbox.write_bytes(path, updated)
    snippet = _snippet_of(updated, line, line + new.count("\n"))
    return Outcome(f"Edited {path}: replaced 1 occurrence at line {line}.\n{snippet}", meta={"path": path, "line": line})


def _closest_text_hint(text: str, old: str, path: str) -> str:
    """Where old_str missed by a little, show the lines it most likely meant, numbered as read_file numbers
    them: agents (and the policy we train) mostly miss by a character or an indent, and copying from the
    error message just read is easier than finding the lines again in an earlier read_file result."""
    fallback = "Read the file again and copy the text exactly."
    lines = text.splitlines(keepends=True)
    width = old.count("\n") + (0 if old.endswith("\n") else 1)
    if not lines or width > EDIT_HINT_MAX_LINES or len(old) > EDIT_HINT_MAX_CHARS or len(text) > EDIT_HINT_MAX_FILE_BYTES:
        return fallback
    width = min(width, len(lines))
    best_ratio, best_start = 0.0, 0
    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2(old)
    for start in range(len(lines) - width + 1):
        matcher.set_seq1("".join(lines[start : start + width]))
        if matcher.real_quick_ratio() <= best_ratio or matcher.quick_ratio() <= best_ratio:
            continue
        ratio = matcher.ratio()
        if ratio > best_ratio:
            best_ratio, best_start = ratio, start
    if best_ratio < EDIT_HINT_MIN_SIMILARITY:
        return fallback
    first, last = best_start + 1, best_start + width
    where = f"line {first}" if first == last else f"lines {first}-{last}"
    return (
        f"The most similar text in {path} is {where}:\n{_edited_snippet(lines, first, last, context=0)}"
        "If you meant it, copy it exactly (without the line numbers) into old_str."
    )


def _edited_snippet(lines: list[str], first: int, last: int, context: int = 3) -> str:
    """Lines first..last with `context` lines either side, numbered as read_file numbers them."""
    lo, hi = max(first - context, 1), min(last + context, len(lines))
    snippet = number_lines(lines[lo - 1 : hi], lo)
    return snippet if not snippet or snippet.endswith("\n") else snippet + "\n"


def _snippet_of(data: bytes, first: int, last: int, context: int = 3) -> str:
    """``_edited_snippet`` on raw bytes without splitting the whole file into line objects."""
    lo, hi = max(first - context, 1), min(last + context, count_lines(data))
    lines = [line + "\n" for line in line_slice(data, lo, hi).decode("utf-8", "replace").split("\n")]
    if lines and lines[-1] == "\n":
        lines.pop()
    return number_lines(lines, lo) if lines else ""


def replace_lines(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    # An edit addressed by line number: the model names lines it read (read_file numbers them) and writes
    # only their new text, so it never has to reproduce the old text exactly as edit_file requires.
    path = normalize_relative(args["path"])
    start, end, new = args["start_line"], args["end_line"], args["new_text"]
    if end < start:
        raise ToolFailure(f"end_line {end} is before start_line {start}")
    # Bytes and line offsets (numbered as read_file numbers them, at '\n'), never a list of every line;
    # bytes outside the replaced lines are written back untouched.
    data = _read_editable(sandbox, path, "replace_lines")
    total = count_lines(data)
    if end > total:
        raise ToolFailure(
            f"{path} has {total} lines, so lines {start}-{end} do not exist; read the file again for the numbers"
        )
    if new and not new.endswith("\n"):
        new += "\n"
    lo = line_offset(data, start)
    hi = line_offset(data, end - start + 2, start=lo)
    if data[lo:hi].decode("utf-8", "replace") == new:
        raise ToolFailure(f"new_text equals lines {start}-{end} of {path}; nothing would change")
    updated = data[:lo] + new.encode("utf-8") + data[hi:]
    del data
    sandbox.write_bytes(path, updated)
    written = new.count("\n")
    plural = "" if end == start else "s"
    summary = f"Edited {path}: replaced line{plural} {start}-{end} with {written} line{'' if written == 1 else 's'}.\n"
    snippet = _snippet_of(updated, start, max(start, start + written - 1))
    return Outcome(summary + snippet, meta={"path": path, "line": start, "lines_removed": end - start + 1,
                                            "lines_written": written})


def create_file(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    path = normalize_relative(args["path"])
    if not path:
        raise ToolFailure("path must name a file inside the workspace")
    overwrite = args.get("overwrite", False)
    if not overwrite:
        parent, _, name = path.rpartition("/")
        try:
            exists = any(entry.name == name for entry in sandbox.list_dir(parent))
        except SandboxError:
            exists = False
        if exists:
            raise ToolFailure(f"{path} already exists; use edit_file, or pass overwrite=true to replace it")
    content = args["content"]
    sandbox.write_bytes(path, content.encode("utf-8"))
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    return Outcome(f"Created {path} ({lines} lines, {len(content.encode('utf-8'))} bytes).\n",
                   meta={"path": path, "lines": lines})


def grep(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    # ripgrep runs inside the sandbox so its directory walk cannot be redirected out by a symlink swap.
    pattern = args["pattern"]
    path = normalize_relative(args.get("path", ".")) or "."
    limit = args.get("max_results", 50)
    argv = ["rg", "--line-number", "--with-filename", "--no-heading", "--color=never", "--sort=path",
            f"--max-columns={GREP_MAX_COLUMNS}", "--max-columns-preview", "--no-messages"]
    if not args.get("case_sensitive", True):
        argv.append("--ignore-case")
    for glob in args.get("globs", []):
        argv += ["--glob", glob]
    argv += ["--regexp", pattern]
    if path != ".":
        argv += ["--", path]
    result = sandbox.exec(" ".join(shlex.quote(part) for part in argv) + f" | head -n {limit + 1}")
    if result.timed_out:
        raise ToolFailure("grep timed out; narrow the path or globs")
    lines = result.stdout.splitlines()
    if not lines:
        if "regex parse error" in result.stderr or "error" in result.stderr.lower():
            raise ToolFailure(f"grep failed: {result.stderr.strip()[:1000]}")
        return Outcome(f"No matches for /{pattern}/ in {path}\n", meta={"matches": 0})
    more = len(lines) > limit
    lines = lines[:limit]
    text = "".join(f"{line}\n" for line in lines)
    if more:
        text += f"[results capped at {limit}; narrow the pattern, path or globs to see the rest]\n"
    return Outcome(text, meta={"matches": len(lines), "capped": more})


def semantic_search(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    try:
        from sandboxes.semantic import semantic_search as search
    except ImportError as exc:
        raise ToolFailure(f"semantic_search is not available on this server ({exc}); use grep instead") from None
    try:
        text = search(sandbox=sandbox, query=args["query"], k=args.get("k", 10))
    except ValueError as exc:
        raise ToolFailure(str(exc)) from None
    return Outcome(text if text.endswith("\n") else text + "\n", meta={"k": args.get("k", 10)})


def read_lints(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    sections = diff_sections(sandbox.diff())
    requested = [normalize_relative(p) for p in args.get("paths", [])]
    if requested:
        paths = [p for p in requested if p.endswith(".py")]
        skipped = [p for p in requested if not p.endswith(".py")]
    else:
        paths = sorted(p for p in sections if p.endswith(".py"))
        skipped = []
    diagnostics = []
    checked = []
    too_big = []
    for path in paths:
        try:
            raw = sandbox.read_bytes(path)
        except SandboxError as exc:
            if path in sections and "+++ /dev/null" in sections[path]:
                continue
            raise ToolFailure(str(exc)) from None
        if len(raw) > LINT_MAX_FILE_BYTES or "\nLarge files " in sections.get(path, ""):
            too_big.append(path)
            continue
        current = raw.decode("utf-8", "replace")
        original = original_from_diff(current, sections[path]) if path in sections else current
        try:
            diagnostics += introduced_diagnostics(path, current, original)
        except LintUnavailable as exc:
            raise ToolFailure(str(exc)) from None
        checked.append(path)
    note = "".join(f"{p}: not a Python file; read_lints checks .py files only\n" for p in skipped)
    note += "".join(f"{p}: over {LINT_MAX_FILE_BYTES} bytes; read_lints does not check files this large\n"
                    for p in too_big)
    if not checked:
        return Outcome(note + "No changed Python files to lint.\n", meta={"files": 0, "diagnostics": 0})
    if not diagnostics:
        return Outcome(note + f"No new lint errors in {len(checked)} file(s).\n",
                       meta={"files": len(checked), "diagnostics": 0})
    body = "".join(d.render() + "\n" for d in diagnostics[:LINT_MAX_DIAGNOSTICS])
    if len(diagnostics) > LINT_MAX_DIAGNOSTICS:
        body += f"[{len(diagnostics) - LINT_MAX_DIAGNOSTICS} more not shown; fix these first]\n"
    return Outcome(note + f"{len(diagnostics)} new lint error(s):\n{body}",
                   meta={"files": len(checked), "diagnostics": len(diagnostics)})


def run_terminal(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    command = args["command"]
    if not command.strip():
        raise ToolFailure("command is empty")
    timeout = min(float(args.get("timeout_s", sandbox.limits.command_timeout_s)), sandbox.limits.command_timeout_s)
    result = sandbox.exec(command, timeout_s=timeout)
    parts = [f"$ {command}\n"]
    if result.stdout:
        parts.append(result.stdout if result.stdout.endswith("\n") else result.stdout + "\n")
    if result.stderr:
        parts.append("[stderr]\n")
        parts.append(result.stderr if result.stderr.endswith("\n") else result.stderr + "\n")
    if result.timed_out:
        parts.append(f"[timed out after {timeout:g}s; the command and its child processes were killed]\n")
    else:
        parts.append(f"[exit code {result.exit_code}]\n")
    return Outcome("".join(parts), ok=result.exit_code == 0 and not result.timed_out,
                   meta={"exit_code": result.exit_code, "timed_out": result.timed_out,
                         "command_duration_s": round(result.duration_s, 4)})


_todo_lists: dict[str, list[dict[str, str]]] = {}
_todo_lock = threading.Lock()
_STATUS_MARK = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}


def todo_list(sandbox: Sandbox) -> list[dict[str, str]]:
    """The sandbox's current todo list (copies), as the agent last wrote it."""
    with _todo_lock:
        return [dict(item) for item in _todo_lists.get(sandbox.id, [])]


def todo_write(sandbox: Sandbox, args: dict[str, Any]) -> Outcome:
    items = [{"id": str(t["id"]), "content": t["content"], "status": t["status"]} for t in args["todos"]]
    ids = [item["id"] for item in items]
    if len(set(ids)) != len(ids):
        raise ToolFailure("todo ids must be unique within one todo_write call")
    with _todo_lock:
        if args.get("merge", False):
            merged = {item["id"]: item for item in _todo_lists.get(sandbox.id, [])}
            order = list(merged)
            for item in items:
                if item["id"] not in merged:
                    order.append(item["id"])
                merged[item["id"]] = item
            current = [merged[i] for i in order]
        else:
            current = items
        _todo_lists[sandbox.id] = current
        snapshot = [dict(item) for item in current]
    done = sum(item["status"] == "completed" for item in snapshot)
    lines = [f"Todo list ({done}/{len(snapshot)} completed):\n"]
    lines += [f"{_STATUS_MARK[item['status']]} {item['id']}. {item['content']}\n" for item in snapshot]
    return Outcome("".join(lines), meta={"todos": snapshot})


def display_of(output: str) -> tuple[str, bool]:
    return head_tail(output)
