"""Mine (natural-language, code) pairs from Python source on this machine, with no network.

Four pair kinds, each rendered exactly as the search index renders a chunk (``chunk_embedding_text``)
so the encoder is trained on what it will see at query time:

- ``docstring``: a function's docstring summary -> the function with its docstrings removed;
- ``comment``: a ``#`` comment inside a function -> that function with the comment removed;
- ``name``: the function name split into words -> the function (docstrings removed);
- ``bug``: a commit-style description of an injected bug -> the buggy function.
"""

from __future__ import annotations

import ast
import os
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandboxes.semantic.chunking import chunk_embedding_text

PAIR_KINDS = ("docstring", "comment", "name", "bug")


@dataclass(frozen=True)
class TrainingPair:
    query: str
    code: str
    """Rendered like an index chunk: ``path symbol`` header line, then the source."""
    kind: str
    group: str
    """Identity of the function the pair came from; pairs of one group never share a batch."""


# --- source transforms shared with the evaluation set ------------------------------------------


def _docstring_line_ranges(tree: ast.AST) -> list[tuple[int, int, int, bool]]:
    """(first line, last line, indent column, is the only statement) of every docstring."""
    ranges = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            ranges.append((first.lineno, first.end_lineno, first.col_offset, len(body) == 1))
    return ranges


def strip_docstrings(source: str) -> str:
    """``source`` without module, class and function docstrings, still valid Python.

    A docstring that is a definition's only statement becomes ``...`` so the body stays valid.
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    for first, last, column, only in sorted(_docstring_line_ranges(tree), reverse=True):
        replacement = [" " * column + "..."] if only else []
        lines[first - 1 : last] = replacement
    return "\n".join(lines) + "\n"


def docstring_summary(docstring: str | None, *, max_chars: int = 300) -> str | None:
    """The first paragraph of a docstring as one line, or None when it is too short to be a query."""
    if not docstring:
        return None
    paragraph = docstring.strip().split("\n\n", 1)[0]
    summary = re.sub(r"\s+", " ", paragraph).strip()
    # Sphinx roles and doctest prompts are markup, not description.
    summary = re.sub(r":\w+:`~?([^`]+)`", r"\1", summary).replace("``", "")
    if summary.startswith(">>>") or len(summary.split()) < 4:
        return None
    return summary[:max_chars]


def split_identifier(name: str) -> str:
    """``parse_HTTPDate`` -> ``parse http date``."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name.strip("_")).replace("_", " ")
    words = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", words)
    return " ".join(words.lower().split())


@dataclass(frozen=True)
class FunctionSource:
    path: str
    symbol: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    code: str
    """The function's source (decorators included) with its docstrings removed."""
    docstring: str | None


def iter_functions(*, path: str, source: str, min_lines: int = 3, max_lines: int = 80) -> Iterator[FunctionSource]:
    """Top-level functions and methods of ``source`` of a searchable size."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()

    def visit(body: list[ast.stmt], prefix: str) -> Iterator[FunctionSource]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - start + 1
                if not min_lines <= length <= max_lines:
                    continue
                text = "\n".join(lines[start - 1 : node.end_lineno])
                code = _dedent_strip(text)
                if code is None:
                    continue
                yield FunctionSource(path, f"{prefix}{node.name}", node, code, ast.get_docstring(node))

    yield from visit(tree.body, "")


def _dedent_strip(text: str) -> str | None:
    import textwrap

    dedented = textwrap.dedent(text)
    try:
        return strip_docstrings(dedented).rstrip("\n")
    except SyntaxError:
        return None


# --- pair kinds ------------------------------------------------------------------------------

_COMMENT = re.compile(r"^\s*#\s?(.*)$")


def _comment_pairs(function: FunctionSource, rng: random.Random) -> list[TrainingPair]:
    lines = function.code.splitlines()
    candidates = []
    for number, line in enumerate(lines):
        match = _COMMENT.match(line)
        if match and len(match.group(1).split()) >= 4 and not match.group(1).startswith(("noqa", "type:", "pragma")):
            candidates.append(number)
    if not candidates:
        return []
    number = rng.choice(candidates)
    query = _COMMENT.match(lines[number]).group(1).strip()
    code = "\n".join(lines[:number] + lines[number + 1 :])
    return [TrainingPair(query, _render(function, code), "comment", _group(function))]


_BUG_MUTATIONS: tuple[tuple[type, type, str], ...] = (
    (ast.Lt, ast.LtE, "off-by-one: comparison uses <= where < is meant"),
    (ast.LtE, ast.Lt, "off-by-one: comparison uses < where <= is meant"),
    (ast.Gt, ast.GtE, "off-by-one: comparison uses >= where > is meant"),
    (ast.GtE, ast.Gt, "off-by-one: comparison uses > where >= is meant"),
    (ast.Eq, ast.NotEq, "inverted equality check"),
    (ast.NotEq, ast.Eq, "inverted inequality check"),
    (ast.Add, ast.Sub, "subtracts where it should add"),
    (ast.Sub, ast.Add, "adds where it should subtract"),
    (ast.And, ast.Or, "uses `or` where both conditions must hold"),
    (ast.Or, ast.And, "uses `and` where either condition suffices"),
    (ast.Is, ast.IsNot, "inverted identity check"),
    (ast.In, ast.NotIn, "inverted membership test"),
)

_BUG_TEMPLATES = (
    "Fix {what} in {name}",
    "{name} is broken: {what}",
    "Bug in {name}: {what}",
    "Repair {name}, which {what_lower}",
)


def _inject_bug(function: FunctionSource, rng: random.Random) -> tuple[str, str] | None:
    """A mutated copy of the function and a description of the bug, or None if nothing can mutate."""
    try:
        tree = ast.parse(function.code)
    except SyntaxError:
        return None
    sites: list[tuple[ast.AST, str, int, type, str]] = []
    for node in ast.walk(tree):
        for field_name, index, operator in _operators(node):
            for original, replacement, description in _BUG_MUTATIONS:
                if type(operator) is original:
                    sites.append((node, field_name, index, replacement, description))
    if not sites:
        return None
    node, field_name, index, replacement, description = rng.choice(sites)
    if index < 0:
        setattr(node, field_name, replacement())
    else:
        getattr(node, field_name)[index] = replacement()
    try:
        mutated = ast.unparse(tree)
    except (ValueError, RecursionError):
        return None
    return mutated, description


def _operators(node: ast.AST) -> Iterator[tuple[str, int, ast.AST]]:
    if isinstance(node, ast.Compare):
        for index, operator in enumerate(node.ops):
            yield "ops", index, operator
    elif isinstance(node, ast.BinOp | ast.BoolOp):
        yield "op", -1, node.op


def _bug_pair(function: FunctionSource, rng: random.Random) -> list[TrainingPair]:
    injected = _inject_bug(function, rng)
    if injected is None:
        return []
    code, what = injected
    name = split_identifier(function.symbol.rsplit(".", 1)[-1])
    template = rng.choice(_BUG_TEMPLATES)
    query = template.format(what=what, what_lower=what, name=name)
    return [TrainingPair(query, _render(function, code), "bug", _group(function))]


def _render(function: FunctionSource, code: str) -> str:
    return chunk_embedding_text(path=function.path, symbol=function.symbol, text=code)


def _group(function: FunctionSource) -> str:
    return f"{function.path}::{function.symbol}"


def function_pairs(function: FunctionSource, rng: random.Random) -> list[TrainingPair]:
    pairs: list[TrainingPair] = []
    summary = docstring_summary(function.docstring)
    if summary:
        pairs.append(TrainingPair(summary, _render(function, function.code), "docstring", _group(function)))
    pairs.extend(_comment_pairs(function, rng))
    name = split_identifier(function.symbol.rsplit(".", 1)[-1])
    if len(name.split()) >= 2:
        pairs.append(TrainingPair(name, _render(function, function.code), "name", _group(function)))
    pairs.extend(_bug_pair(function, rng))
    return pairs


_SKIPPED_DIRECTORIES = frozenset({"tests", "test", "testing", "__pycache__", "migrations"})


def iter_python_files(roots: Iterable[Path], *, excluded: Iterable[Path] = ()) -> Iterator[Path]:
    """``*.py`` files under each root in sorted order, skipping test/migration directories and
    anything under ``excluded``. Excluded and skipped directories are pruned before the walk enters
    them (the stdlib root holds a site-packages of ~10k files that would otherwise be walked)."""
    excluded_resolved = frozenset(path.resolve() for path in excluded)

    def is_excluded(resolved: Path) -> bool:
        return resolved in excluded_resolved or any(parent in excluded_resolved for parent in resolved.parents)

    for root in roots:
        root = Path(root)
        if _SKIPPED_DIRECTORIES.intersection(root.parts) or is_excluded(root.resolve()):
            continue
        found = []
        for directory, subdirectories, files in os.walk(root):
            subdirectories[:] = [
                name
                for name in subdirectories
                if name not in _SKIPPED_DIRECTORIES and Path(directory, name).resolve() not in excluded_resolved
            ]
            found.extend(Path(directory, name) for name in files if name.endswith(".py"))
        for path in sorted(found):
            if not is_excluded(path.resolve()):
                yield path


def mine_pairs(
    *,
    roots: Iterable[Path],
    max_pairs: int,
    seed: int,
    kind_fractions: dict[str, float] | None = None,
    excluded: Iterable[Path] = (),
    max_pairs_per_file: int = 8,
) -> list[TrainingPair]:
    """Up to ``max_pairs`` pairs from Python files under ``roots`` (files under ``excluded`` skipped).

    Files are visited in a seeded random order and each contributes at most ``max_pairs_per_file``
    so a few huge modules cannot dominate the set. ``kind_fractions`` caps each pair kind's share
    (default: all kinds equal); a kind that runs short leaves its share unfilled.
    """
    fractions = kind_fractions or {kind: 1 / len(PAIR_KINDS) for kind in PAIR_KINDS}
    unknown = set(fractions) - set(PAIR_KINDS)
    if unknown:
        raise ValueError(f"unknown pair kinds {sorted(unknown)}; choose from {PAIR_KINDS}")
    quota = {kind: round(max_pairs * fractions.get(kind, 0.0)) for kind in PAIR_KINDS}
    taken = dict.fromkeys(PAIR_KINDS, 0)
    rng = random.Random(seed)
    roots = [Path(root) for root in roots]
    files = list(iter_python_files(roots, excluded=excluded))
    rng.shuffle(files)
    pairs: list[TrainingPair] = []
    seen: set[tuple[str, str]] = set()
    for file_path in files:
        try:
            source = file_path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        root = next(root for root in roots if root == file_path or root in file_path.parents)
        relative = file_path.relative_to(root.parent).as_posix()
        file_pairs: list[TrainingPair] = []
        for function in iter_functions(path=relative, source=source):
            file_pairs.extend(function_pairs(function, rng))
        rng.shuffle(file_pairs)
        kept = 0
        for pair in file_pairs:
            key = (pair.query.lower(), pair.code)
            if kept >= max_pairs_per_file or key in seen or taken[pair.kind] >= quota[pair.kind]:
                continue
            seen.add(key)
            pairs.append(pair)
            taken[pair.kind] += 1
            kept += 1
        if all(taken[kind] >= quota[kind] for kind in PAIR_KINDS):
            break
    rng.shuffle(pairs)
    return pairs
