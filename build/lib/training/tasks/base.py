"""The task record shared by every tier: a repository with one injected bug and hidden tests."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

TIERS: tuple[str, ...] = ("toy", "real")
SPLITS: tuple[str, ...] = ("train", "heldout")


class TaskError(ValueError):
    """A task that cannot be built or used as asked; the message says how to fix the call."""


@dataclass(frozen=True)
class FileEdit:
    """A search-and-replace edit: `old_text` occurs exactly once in the file at `path`."""

    path: str
    """File to edit, relative to the repository root."""
    old_text: str
    """Exact text to replace (unique in the buggy file)."""
    new_text: str
    """Replacement text."""

    def apply(self, content: str) -> str:
        if content.count(self.old_text) != 1:
            raise TaskError(
                f"{self.path}: the edit's old_text occurs {content.count(self.old_text)} times; it must occur once"
            )
        return content.replace(self.old_text, self.new_text)

    def as_line_range(self, content: str) -> LineEdit:
        """The same fix addressed by line numbers of `content`: only the lines that change, new text.

        A pure insertion (a removed statement put back) also rewrites the shorter of its neighbouring
        lines, because a line range cannot be empty.
        """
        fixed = self.apply(content).splitlines(keepends=True)
        buggy = content.splitlines(keepends=True)
        span = changed_line_span(buggy, fixed)
        if span is None:
            raise TaskError(f"{self.path}: the edit changes nothing")
        b_start, b_end, f_start, f_end = span
        if b_start == b_end:
            above = len(buggy[b_start - 1]) if b_start > 0 else None
            below = len(buggy[b_end]) if b_end < len(buggy) else None
            if above is None or (below is not None and below < above):
                b_end, f_end = b_end + 1, f_end + 1
            else:
                b_start, f_start = b_start - 1, f_start - 1
        return LineEdit(path=self.path, start_line=b_start + 1, end_line=b_end,
                        new_text="".join(fixed[f_start:f_end]))


@dataclass(frozen=True)
class LineEdit:
    """An edit addressed by line numbers, in the shape of the replace_lines tool's arguments."""

    path: str
    """File to edit, relative to the repository root."""
    start_line: int
    """First replaced line (1-based)."""
    end_line: int
    """Last replaced line (inclusive)."""
    new_text: str
    """Text that takes the place of those lines."""

    def apply(self, content: str) -> str:
        lines = content.splitlines(keepends=True)
        return "".join(lines[: self.start_line - 1]) + self.new_text + "".join(lines[self.end_line :])


@dataclass(frozen=True)
class CodingTask:
    """A bug-fixing task: the agent sees `files` and `prompt`; `hidden_tests` score the result."""

    task_id: str
    """Stable id, e.g. "toy-17" or "real-bisect-3f2a..."; unique within a tier."""
    tier: str
    """"toy" (generated repositories) or "real" (mined from real code)."""
    split: str
    """"train" or "heldout"; held-out tasks never share code with training tasks."""
    prompt: str
    """The issue text given to the agent."""
    files: dict[str, str]
    """Repository content the agent starts from, path -> text (the bug is already injected)."""
    hidden_tests: dict[str, str]
    """Test files written over the repository just before scoring, path -> text."""
    test_command: str
    """Shell command, run at the repository root, that executes the hidden tests verbosely."""
    fail_to_pass: tuple[str, ...]
    """Test ids that fail with the bug and must pass after the fix."""
    pass_to_pass: tuple[str, ...]
    """Test ids that pass with the bug and must keep passing."""
    solution: FileEdit
    """The reference fix (the exact inverse of the injected mutation)."""
    mutation_kind: str
    """Which mutator injected the bug (see training.tasks.mutations.MUTATION_KINDS)."""
    mutation_description: str
    """Human-readable summary of the injected bug (never shown to the agent)."""
    metadata: dict = field(default_factory=dict)
    """Tier-specific provenance: seed, module, function, line."""
    test_timeout_s: float = 60.0
    """Wall-clock limit of one hidden-test run; a run past it scores zero (the code hangs)."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise TaskError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if self.split not in SPLITS:
            raise TaskError(f"split must be one of {SPLITS}, got {self.split!r}")
        if not self.fail_to_pass:
            raise TaskError(f"task {self.task_id} has no fail-to-pass test, so it cannot be scored")
        if self.solution.path not in self.files:
            raise TaskError(
                f"task {self.task_id}: solution edits {self.solution.path}, which is not in files"
            )

    def solved_files(self) -> dict[str, str]:
        """The repository with the reference fix applied."""
        fixed = dict(self.files)
        fixed[self.solution.path] = self.solution.apply(self.files[self.solution.path])
        return fixed

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CodingTask:
        data = json.loads(text)
        data["solution"] = FileEdit(**data["solution"])
        data["fail_to_pass"] = tuple(data["fail_to_pass"])
        data["pass_to_pass"] = tuple(data["pass_to_pass"])
        return cls(**data)

    def materialize(self, root: Path) -> Path:
        """Write the agent-visible repository under `root` (created if missing) and return it."""
        root.mkdir(parents=True, exist_ok=True)
        for relative, text in self.files.items():
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return root


def changed_line_span(buggy_lines: list[str], fixed_lines: list[str]) -> tuple[int, int, int, int] | None:
    """(buggy start, buggy end, fixed start, fixed end), 0-based half-open, of the lines between the first
    and the last difference of two line lists; None when they are equal."""
    hunks = [
        op
        for op in difflib.SequenceMatcher(a=buggy_lines, b=fixed_lines, autojunk=False).get_opcodes()
        if op[0] != "equal"
    ]
    if not hunks:
        return None
    return hunks[0][1], hunks[-1][2], hunks[0][3], hunks[-1][4]


def minimal_fix_edit(*, path: str, buggy: str, fixed: str) -> FileEdit:
    """The smallest unique search/replace edit that turns `buggy` into `fixed`.

    Context lines are added around the changed hunk until its old text occurs once in the file,
    which is what an agent's edit_file call has to satisfy as well.
    """
    buggy_lines = buggy.splitlines(keepends=True)
    fixed_lines = fixed.splitlines(keepends=True)
    span = changed_line_span(buggy_lines, fixed_lines)
    if span is None:
        raise TaskError(f"{path}: buggy and fixed text are identical")
    b_start, b_end, f_start, f_end = span
    while True:
        old_text = "".join(buggy_lines[b_start:b_end])
        if old_text.strip() and buggy.count(old_text) == 1:
            return FileEdit(path=path, old_text=old_text, new_text="".join(fixed_lines[f_start:f_end]))
        if b_start == 0 and b_end == len(buggy_lines):
            raise TaskError(f"{path}: no unique context around the change")
        if b_start > 0:
            b_start -= 1
            f_start -= 1
        if b_end < len(buggy_lines):
            b_end += 1
            f_end += 1
