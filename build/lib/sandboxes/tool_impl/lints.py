"""Lint diagnostics the agent introduced, computed on the host so every backend gives the same text.

Ruff runs in isolated mode (no project configuration) with the pyflakes rules and syntax errors,
over file bytes read from the sandbox. A diagnostic counts as introduced when the current file has
more occurrences of its (code, message) than the snapshot version had, so line shifts caused by
unrelated edits do not resurface old warnings.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

RUFF_RULES = "F,E9"
"""Pyflakes checks plus syntax errors: real bugs, not style."""


@dataclass(frozen=True)
class Diagnostic:
    path: str
    line: int
    column: int
    code: str
    message: str

    def render(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.code} {self.message}"


class LintUnavailable(RuntimeError):
    """The ruff executable could not be found or run."""


def _ruff_executable() -> str:
    candidate = Path(sys.executable).with_name("ruff")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("ruff")
    if found is None:
        raise LintUnavailable("ruff is not installed on the host; read_lints cannot run")
    return found


def lint_source(path: str, source: str) -> list[Diagnostic]:
    """Diagnostics for one Python file's text, sorted by position."""
    result = subprocess.run(
        [_ruff_executable(), "check", "--isolated", "--select", RUFF_RULES, "--output-format", "json",
         "--no-cache", "--stdin-filename", path, "-"],
        input=source.encode("utf-8"), capture_output=True, timeout=60, check=False, cwd="/",
    )
    if result.returncode not in (0, 1):
        raise LintUnavailable(f"ruff failed: {result.stderr.decode('utf-8', 'replace').strip()[:500]}")
    diagnostics = []
    for item in json.loads(result.stdout or b"[]"):
        location = item.get("location") or {"row": 1, "column": 1}
        diagnostics.append(Diagnostic(path=path, line=int(location["row"]), column=int(location["column"]),
                                      code=item.get("code") or "E999", message=item["message"]))
    return sorted(diagnostics, key=lambda d: (d.line, d.column, d.code, d.message))


def introduced_diagnostics(path: str, current: str, original: str | None) -> list[Diagnostic]:
    now = lint_source(path, current)
    if original is None:
        return now
    budget = Counter((d.code, d.message) for d in lint_source(path, original))
    introduced = []
    for diagnostic in now:
        key = (diagnostic.code, diagnostic.message)
        if budget[key] > 0:
            budget[key] -= 1
        else:
            introduced.append(diagnostic)
    return introduced
