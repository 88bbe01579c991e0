"""The agent's tools: one definition shared by cloud agents and RL rollouts.

``openai_tool_schemas()`` exports the JSON schemas in OpenAI's ``tools`` format and
``execute_tool_calls`` runs one model turn's calls against a sandbox. Results are plain,
deterministic text, identical whichever backend runs the sandbox.

Calls in a batch run concurrently on a thread pool unless they conflict: two calls touching the
same path, or ``run_terminal``/``edit_file``/``replace_lines`` with anything, run in the order the
model gave them. Results always come back in call order.

Errors the agent caused (bad arguments, paths outside the workspace, no match for an edit, quota
full) come back as results with ``ok=False`` and a message saying what to do. Infrastructure
failures (``SandboxGone``, ``BackendUnavailable``) are raised, so a caller never scores them as the
agent's failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from sandboxes.base import BackendUnavailable, Sandbox, SandboxError, SandboxGone
from sandboxes.safe_fs import normalize_relative
from sandboxes.tool_impl import handlers
from sandboxes.tool_impl.handlers import Outcome, ToolFailure, todo_list

__all__ = ["TOOL_NAMES", "ToolCall", "ToolResult", "execute_tool_calls", "openai_tool_schemas", "todo_list"]

MAX_PARALLEL_CALLS = 16
"""Threads of the process-wide pool that runs independent tool calls."""

HOST_SIDE_TOOLS = frozenset({"read_file", "list_dir", "create_file", "edit_file", "replace_lines", "todo_write"})
"""Tools served by host-side file access in microseconds; a batch of only these runs inline, in order."""

EVERYTHING = "*"
"""Pseudo-path meaning a call may touch any file."""


@dataclass(frozen=True)
class ToolCall:
    """One tool invocation requested by the model."""

    id: str
    """The model's call id, echoed in the result."""
    name: str
    """Tool name, one of TOOL_NAMES."""
    arguments: dict
    """Parsed JSON arguments."""


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one ToolCall."""

    call_id: str
    """Id of the call this answers."""
    name: str
    """Tool name."""
    ok: bool
    """False when the call failed (bad arguments, refused path, non-zero exit, timeout)."""
    output: str
    """Full result text, given to the model."""
    display: str
    """Head+tail truncated text for the UI, with a note saying what was cut."""
    duration_s: float
    """Wall-clock seconds the call took."""
    meta: dict = field(default_factory=dict)
    """Structured details (exit code, path, match counts, todos, truncated flag)."""


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    handler: Callable[[Sandbox, dict[str, Any]], Outcome]
    reads: Callable[[dict[str, Any]], set[str]]
    writes: Callable[[dict[str, Any]], set[str]]


def _path_arg(key: str, default: str | None = None) -> Callable[[dict[str, Any]], set[str]]:
    def paths(args: dict[str, Any]) -> set[str]:
        try:
            return {normalize_relative(args.get(key, default))}
        except SandboxError:
            return set()

    return paths


def _nothing(args: dict[str, Any]) -> set[str]:
    return set()


def _everything(args: dict[str, Any]) -> set[str]:
    return {EVERYTHING}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_PATH = {"type": "string", "minLength": 1, "description": "Path relative to the workspace root (/workspace)."}

_TOOLS: tuple[_Tool, ...] = (
    _Tool(
        "read_file",
        "Read a text file with numbered lines. Optionally give a 1-based inclusive line range; "
        f"at most {handlers.READ_FILE_MAX_LINES} lines are returned per call.",
        _object({
            "path": _PATH,
            "start_line": {"type": "integer", "minimum": 1, "description": "First line to show (1-based)."},
            "end_line": {"type": "integer", "minimum": 1, "description": "Last line to show (inclusive)."},
        }, ["path"]),
        handlers.read_file, _path_arg("path"), _nothing,
    ),
    _Tool(
        "list_dir",
        "List a directory of the workspace: sub-directories end with '/', symlinks with '@', files show sizes.",
        _object({"path": {**_PATH, "description": "Directory relative to the workspace root; default '.'."}}, []),
        handlers.list_dir, _everything, _nothing,
    ),
    _Tool(
        "edit_file",
        "Replace text in a file: old_str must match the file exactly once (whitespace included); "
        "it is replaced by new_str. On zero or several matches nothing changes and the error says where.",
        _object({
            "path": _PATH,
            "old_str": {"type": "string", "description": "Exact text to replace, unique in the file."},
            "new_str": {"type": "string", "description": "Replacement text."},
        }, ["path", "old_str", "new_str"]),
        handlers.edit_file, _everything, _everything,
    ),
    _Tool(
        "replace_lines",
        "Replace lines start_line..end_line (1-based, inclusive, as read_file numbers them) of a file with "
        "new_text, which may hold more or fewer lines; an empty new_text deletes them.",
        _object({
            "path": _PATH,
            "start_line": {"type": "integer", "minimum": 1, "description": "First line to replace."},
            "end_line": {"type": "integer", "minimum": 1, "description": "Last line to replace (inclusive)."},
            "new_text": {"type": "string", "description": "Replacement lines, indentation included."},
        }, ["path", "start_line", "end_line", "new_text"]),
        handlers.replace_lines, _everything, _everything,
    ),
    _Tool(
        "create_file",
        "Create a new file (parent directories are created). Fails if the file exists unless overwrite is true.",
        _object({
            "path": _PATH,
            "content": {"type": "string", "description": "Full file content."},
            "overwrite": {"type": "boolean", "description": "Replace an existing file. Default false."},
        }, ["path", "content"]),
        handlers.create_file, _path_arg("path"), _path_arg("path"),
    ),
    _Tool(
        "grep",
        "Search file contents with a ripgrep (Rust) regular expression. Returns path:line:text matches "
        "sorted by path, capped at max_results.",
        _object({
            "pattern": {"type": "string", "minLength": 1, "description": "Regular expression (ripgrep syntax)."},
            "path": {**_PATH, "description": "File or directory to search; default '.'."},
            "globs": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 20,
                      "description": "Include/exclude globs, e.g. ['*.py', '!tests/**']."},
            "case_sensitive": {"type": "boolean", "description": "Default true."},
            "max_results": {"type": "integer", "minimum": 1, "maximum": handlers.GREP_MAX_RESULTS,
                            "description": "Most matching lines to return; default 50."},
        }, ["pattern"]),
        handlers.grep, _everything, _nothing,
    ),
    _Tool(
        "semantic_search",
        "Find code by meaning: returns the k workspace snippets most relevant to a natural-language query, "
        "with path, line range and score.",
        _object({
            "query": {"type": "string", "minLength": 1, "description": "What you are looking for, in words."},
            "k": {"type": "integer", "minimum": 1, "maximum": 50, "description": "Number of results; default 10."},
        }, ["query"]),
        handlers.semantic_search, _everything, _nothing,
    ),
    _Tool(
        "read_lints",
        "Report lint errors (pyflakes rules and syntax errors) that your changes introduced, compared with "
        "the original files. Without paths, checks every changed Python file.",
        _object({
            "paths": {"type": "array", "items": _PATH, "maxItems": 100, "description": "Files to check."},
        }, []),
        handlers.read_lints, _everything, _nothing,
    ),
    _Tool(
        "run_terminal",
        "Run a shell command (/bin/sh -c) in the workspace as an unprivileged user without network. "
        "Returns stdout, stderr and the exit code; long-running commands are killed at the timeout.",
        _object({
            "command": {"type": "string", "minLength": 1, "description": "Shell command line."},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0,
                          "description": "Wall-clock limit in seconds (capped by the sandbox limit)."},
        }, ["command"]),
        handlers.run_terminal, _everything, _everything,
    ),
    _Tool(
        "todo_write",
        "Write your task list. Each item has an id, content and status "
        "(pending, in_progress, completed, cancelled). merge=true updates items by id; otherwise replaces the list.",
        _object({
            "todos": {"type": "array", "maxItems": 100, "items": _object({
                "id": {"type": "string", "minLength": 1},
                "content": {"type": "string", "minLength": 1},
                "status": {"type": "string", "enum": ["pending", "in_progress", "completed", "cancelled"]},
            }, ["id", "content", "status"])},
            "merge": {"type": "boolean", "description": "Merge into the existing list by id. Default false."},
        }, ["todos"]),
        handlers.todo_write, lambda args: {"\x00todos"}, lambda args: {"\x00todos"},
    ),
)

TOOLS_BY_NAME = {tool.name: tool for tool in _TOOLS}
TOOL_NAMES = tuple(TOOLS_BY_NAME)
_VALIDATORS = {tool.name: jsonschema.Draft202012Validator(tool.parameters) for tool in _TOOLS}
for _tool in _TOOLS:
    jsonschema.Draft202012Validator.check_schema(_tool.parameters)


def openai_tool_schemas() -> list[dict[str, Any]]:
    """Every tool in OpenAI's ``tools`` format (function name, description, JSON-schema parameters)."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in _TOOLS
    ]


def _argument_error(call: ToolCall) -> str | None:
    tool = TOOLS_BY_NAME.get(call.name)
    if tool is None:
        return f"unknown tool {call.name!r}; available tools: {', '.join(TOOL_NAMES)}"
    if not isinstance(call.arguments, dict):
        return f"arguments for {call.name} must be a JSON object, got {type(call.arguments).__name__}"
    errors = sorted(_VALIDATORS[call.name].iter_errors(call.arguments), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.path)
        return f"invalid arguments for {call.name}: {(where + ': ') if where else ''}{first.message}"
    return None


def _result(call: ToolCall, outcome: Outcome, started: float) -> ToolResult:
    display, truncated = handlers.display_of(outcome.output)
    return ToolResult(call_id=call.id, name=call.name, ok=outcome.ok, output=outcome.output, display=display,
                      duration_s=time.monotonic() - started, meta={**outcome.meta, "truncated": truncated})


def execute_tool_call(*, sandbox: Sandbox, call: ToolCall) -> ToolResult:
    """Run one call. Agent mistakes become ok=False results; SandboxGone/BackendUnavailable propagate."""
    started = time.monotonic()
    problem = _argument_error(call)
    if problem is not None:
        return _result(call, Outcome(f"Error: {problem}\n", ok=False, meta={"error": "invalid_arguments"}), started)
    tool = TOOLS_BY_NAME[call.name]
    try:
        outcome = tool.handler(sandbox, call.arguments)
    except (SandboxGone, BackendUnavailable):
        raise
    except (ToolFailure, SandboxError) as exc:
        kind = type(exc).__name__
        outcome = Outcome(f"Error: {exc}\n", ok=False, meta={"error": kind})
    return _result(call, outcome, started)


def _conflicts(a: _Tool, a_args: dict[str, Any], b: _Tool, b_args: dict[str, Any]) -> bool:
    a_reads, a_writes = a.reads(a_args) | a.writes(a_args), a.writes(a_args)
    b_reads, b_writes = b.reads(b_args) | b.writes(b_args), b.writes(b_args)

    def overlap(x: set[str], y: set[str]) -> bool:
        if not x or not y:
            return False
        return EVERYTHING in x or EVERYTHING in y or bool(x & y)

    return overlap(a_writes, b_reads) or overlap(b_writes, a_reads)


def execute_tool_calls(*, sandbox: Sandbox, calls: list[ToolCall]) -> list[ToolResult]:
    """Run one model turn's calls, concurrently where independent; results are in call order."""
    if not calls:
        return []
    run_on_host = getattr(sandbox, "run_tools", None)
    if run_on_host is not None:
        # A sandbox behind a host actor (sandboxes.fleet) runs the whole turn on its host, which
        # applies the rules below there: one round trip per model turn instead of one per call.
        return run_on_host(calls)
    if len(calls) == 1 or all(call.name in HOST_SIDE_TOOLS for call in calls):
        # Host-side file tools take tens of microseconds under the GIL; thread hand-offs would cost more.
        return [execute_tool_call(sandbox=sandbox, call=call) for call in calls]
    resolved = []
    for call in calls:
        tool = TOOLS_BY_NAME.get(call.name)
        valid = tool is not None and _argument_error(call) is None
        resolved.append((tool, call.arguments if valid else {}))
    # A call only ever waits on calls submitted before it, which the FIFO pool has already started, so
    # sharing one pool between concurrent batches cannot deadlock.
    pool = _shared_pool()
    futures: list[Future[ToolResult]] = []
    for index, call in enumerate(calls):
        tool, args = resolved[index]
        waits = []
        if tool is not None:
            for earlier in range(index):
                other, other_args = resolved[earlier]
                if other is not None and _conflicts(tool, args, other, other_args):
                    waits.append(futures[earlier])

        def run(call: ToolCall = call, waits: list[Future[ToolResult]] = waits) -> ToolResult:
            for dependency in waits:
                dependency.exception()
            return execute_tool_call(sandbox=sandbox, call=call)

        futures.append(pool.submit(run))
    return [future.result() for future in futures]


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL_CALLS, thread_name_prefix="sandbox-tool")
        return _pool
