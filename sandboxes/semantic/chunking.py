"""Cut source files into chunks that a search hit can point at: path plus 1-based inclusive lines.

Python files are cut by syntax (module head, top-level functions, classes with their methods as
separate chunks); other text files, and Python files that do not parse, fall back to overlapping
line windows. Chunks never exceed ``max_chunk_lines``: long definitions are split into windows that
keep the definition's symbol so a hit on any window names the function it belongs to.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import PurePosixPath

from sandboxes.semantic.config import ChunkingConfig

# Extensions whose contents are text a coding agent may want to find; everything else is skipped.
TEXT_EXTENSIONS = frozenset(
    {
        ".py", ".pyi", ".js", ".jsx", ".ts", ".tsx", ".mjs", ".cjs", ".go", ".rs", ".java", ".kt", ".c",
        ".h", ".cc", ".cpp", ".hpp", ".cs", ".rb", ".php", ".swift", ".scala", ".sh", ".bash", ".sql",
        ".html", ".css", ".scss", ".md", ".rst", ".txt", ".toml", ".yaml", ".yml", ".json", ".cfg", ".ini",
        ".proto", ".graphql", ".vue", ".svelte", ".lua", ".r", ".jl", ".ex", ".exs", ".hs", ".ml", ".zig",
    }
)
TEXT_FILENAMES = frozenset({"Makefile", "Dockerfile", "README", "LICENSE", "CMakeLists.txt"})
SKIPPED_DIRECTORIES = frozenset(
    {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache",
     ".ruff_cache", ".tox", "dist", "build", ".idea", ".vscode", ".eggs"}
)


@dataclass(frozen=True)
class Chunk:
    path: str
    """Repository-relative POSIX path."""
    start_line: int
    """First line, 1-based."""
    end_line: int
    """Last line, inclusive."""
    kind: str
    """``module``, ``function``, ``class``, ``method`` or ``window``."""
    symbol: str
    """Qualified name of the definition (``Class.method``), or empty for module heads and windows."""
    text: str
    """The chunk's source lines."""

    def embedding_text(self) -> str:
        return chunk_embedding_text(path=self.path, symbol=self.symbol, text=self.text)


def chunk_embedding_text(*, path: str, symbol: str, text: str) -> str:
    """The text the encoder sees for a chunk; fine-tuning renders its positives the same way."""
    header = f"{path} {symbol}".strip()
    return f"{header}\n{text}"


def is_indexable_path(path: str) -> bool:
    pure = PurePosixPath(path)
    if any(part in SKIPPED_DIRECTORIES for part in pure.parts[:-1]):
        return False
    return pure.suffix.lower() in TEXT_EXTENSIONS or pure.name in TEXT_FILENAMES


def decode_source(data: bytes) -> str | None:
    """Text of a file, or None for binary content (a NUL byte or invalid UTF-8)."""
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def chunk_file(*, path: str, source: str, config: ChunkingConfig) -> list[Chunk]:
    lines = source.splitlines()
    if not lines or not source.strip():
        return []
    if path.endswith((".py", ".pyi")):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            return _python_chunks(path=path, lines=lines, tree=tree, config=config)
    return _windows(path=path, lines=lines, start=1, end=len(lines), kind="window", symbol="", config=config)


_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _definition_start(node: _Definition) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


def _python_chunks(*, path: str, lines: list[str], tree: ast.Module, config: ChunkingConfig) -> list[Chunk]:
    chunks: list[Chunk] = []
    definitions = [
        node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    covered: set[int] = set()
    for node in definitions:
        chunks.extend(_definition_chunks(path=path, lines=lines, node=node, prefix="", config=config))
        covered.update(range(_definition_start(node), (node.end_lineno or node.lineno) + 1))

    # Statements outside definitions (imports, constants, the `if __name__` block) form the module
    # head and the glue between definitions; keep them searchable as windows of contiguous lines.
    loose: list[tuple[int, int]] = []
    interrupted = True
    for line_number in range(1, len(lines) + 1):
        if line_number in covered:
            interrupted = True
            continue
        if not lines[line_number - 1].strip():
            continue
        if loose and not interrupted:
            loose[-1] = (loose[-1][0], line_number)
        else:
            loose.append((line_number, line_number))
        interrupted = False
    for position, (start, end) in enumerate(loose):
        kind = "module" if position == 0 else "window"
        chunks.extend(_windows(path=path, lines=lines, start=start, end=end, kind=kind, symbol="", config=config))
    chunks.sort(key=lambda chunk: (chunk.start_line, chunk.end_line))
    return chunks


def _definition_chunks(
    *, path: str, lines: list[str], node: _Definition, prefix: str, config: ChunkingConfig
) -> list[Chunk]:
    symbol = f"{prefix}{node.name}"
    start, end = _definition_start(node), node.end_lineno or node.lineno
    if isinstance(node, ast.ClassDef):
        methods = [
            child for child in node.body if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        if end - start + 1 <= config.max_chunk_lines or not methods:
            return _windows(path=path, lines=lines, start=start, end=end, kind="class", symbol=symbol, config=config)
        # A large class: its header (up to the first method) is one chunk, each method another.
        chunks = _windows(
            path=path, lines=lines, start=start, end=_definition_start(methods[0]) - 1, kind="class",
            symbol=symbol, config=config,
        )
        for method in methods:
            nested = _definition_chunks(path=path, lines=lines, node=method, prefix=f"{symbol}.", config=config)
            chunks.extend(
                Chunk(c.path, c.start_line, c.end_line, "method" if c.kind == "function" else c.kind, c.symbol, c.text)
                for c in nested
            )
        return chunks
    return _windows(path=path, lines=lines, start=start, end=end, kind="function", symbol=symbol, config=config)


def _windows(
    *, path: str, lines: list[str], start: int, end: int, kind: str, symbol: str, config: ChunkingConfig
) -> list[Chunk]:
    chunks: list[Chunk] = []
    step = config.max_chunk_lines - config.window_overlap_lines
    window_start = start
    while window_start <= end:
        window_end = min(end, window_start + config.max_chunk_lines - 1)
        text = "\n".join(lines[window_start - 1 : window_end])
        if text.strip():
            chunks.append(Chunk(path, window_start, window_end, kind, symbol, text))
        if window_end == end:
            break
        window_start += step
    return chunks
