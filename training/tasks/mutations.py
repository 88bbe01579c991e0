"""SWE-smith style bug injection: small, local AST mutations spliced back into the original text.

Each mutation rewrites one node and replaces only that node's source segment, so the injected
bug is a one-line diff and the rest of the file keeps its formatting and comments. The same
mutators feed the toy tier (generated code) and the real tier (mined code).
"""

from __future__ import annotations

import ast
import copy
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

MUTATION_KINDS: tuple[str, ...] = (
    "compare_swap",
    "operator_swap",
    "boolean_swap",
    "off_by_one",
    "negate_condition",
    "remove_guard",
    "swap_arguments",
    "remove_statement",
)

_COMPARE_SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_OPERATOR_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.FloorDiv: ast.Mod,
    ast.Mod: ast.FloorDiv,
    ast.Div: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}


class MutationError(ValueError):
    """The source cannot be mutated (syntax error, or no candidate site); the message says why."""


@dataclass(frozen=True)
class Mutation:
    """One injected bug: where it is, what it does, and the file before and after."""

    kind: str
    """One of MUTATION_KINDS."""
    path: str
    """Path of the mutated file inside its repository."""
    function: str
    """Qualified name of the function that contains the bug."""
    lineno: int
    """First line (1-based) of the mutated node."""
    description: str
    """Human-readable summary, e.g. "`<` became `<=`"."""
    original_source: str
    """The whole file before the mutation."""
    mutated_source: str
    """The whole file with the bug."""

    @property
    def fingerprint(self) -> str:
        """Stable id of the bug, for deduplication across mining runs."""
        digest = hashlib.sha256(f"{self.path}\0{self.mutated_source}".encode()).hexdigest()
        return digest[:16]


class _SourceText:
    """Maps AST (line, UTF-8 byte column) positions to offsets in the encoded source."""

    def __init__(self, source: str) -> None:
        self.data = source.encode("utf-8")
        self.line_starts = [0]
        for index, byte in enumerate(self.data):
            if byte == 0x0A:
                self.line_starts.append(index + 1)

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.line_starts[node.lineno - 1] + node.col_offset
        end = self.line_starts[node.end_lineno - 1] + node.end_col_offset
        return start, end

    def line_span(self, first_line: int, last_line: int) -> tuple[int, int]:
        start = self.line_starts[first_line - 1]
        end = self.line_starts[last_line] if last_line < len(self.line_starts) else len(self.data)
        return start, end

    def splice(self, start: int, end: int, text: str) -> str:
        return (self.data[:start] + text.encode("utf-8") + self.data[end:]).decode("utf-8")


def _op_symbol(op: ast.AST) -> str:
    return {
        ast.Lt: "<",
        ast.LtE: "<=",
        ast.Gt: ">",
        ast.GtE: ">=",
        ast.Eq: "==",
        ast.NotEq: "!=",
        ast.In: "in",
        ast.NotIn: "not in",
        ast.Is: "is",
        ast.IsNot: "is not",
        ast.Add: "+",
        ast.Sub: "-",
        ast.Mult: "*",
        ast.FloorDiv: "//",
        ast.Mod: "%",
        ast.Div: "/",
        ast.BitAnd: "&",
        ast.BitOr: "|",
        ast.LShift: "<<",
        ast.RShift: ">>",
        ast.And: "and",
        ast.Or: "or",
    }[type(op)]


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Top-level functions and methods of top-level classes, with qualified names."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _body_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """Nodes inside the function body, excluding decorators, defaults, annotations and docstring."""
    body = list(function.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for statement in body:
        yield from ast.walk(statement)


def _statement_lists(function: ast.AST) -> Iterator[list[ast.stmt]]:
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody"):
            value = getattr(node, field, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                yield value


def _single_line_owner(text: _SourceText, node: ast.stmt) -> bool:
    """True if no other statement shares the node's lines (so whole lines can be removed)."""
    if node.lineno != node.end_lineno:
        return False
    start, end = text.line_span(node.lineno, node.end_lineno)
    line = text.data[start:end].decode("utf-8")
    return ";" not in line


def _candidates(text: _SourceText, qualname: str, function: ast.AST) -> Iterator[tuple[str, int, str, str]]:
    """(kind, lineno, description, mutated_source) for every site in one function."""
    yield from _expression_candidates(text, function)
    yield from _statement_candidates(text, function)


def _expression_candidates(text: _SourceText, function: ast.AST) -> Iterator[tuple[str, int, str, str]]:
    """Mutations of one expression each: swapped operators, off-by-one constants, negated tests, swapped args."""
    for node in _body_nodes(function):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAPS:
            new = copy.deepcopy(node)
            new.ops = [_COMPARE_SWAPS[type(node.ops[0])]()]
            desc = f"`{_op_symbol(node.ops[0])}` became `{_op_symbol(new.ops[0])}`"
            yield "compare_swap", node.lineno, desc, text.splice(*text.span(node), ast.unparse(new))
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATOR_SWAPS:
            new = copy.deepcopy(node)
            new.op = _OPERATOR_SWAPS[type(node.op)]()
            desc = f"`{_op_symbol(node.op)}` became `{_op_symbol(new.op)}`"
            yield "operator_swap", node.lineno, desc, text.splice(*text.span(node), _paren(new))
        elif isinstance(node, ast.BoolOp):
            new = copy.deepcopy(node)
            new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            desc = f"`{_op_symbol(node.op)}` became `{_op_symbol(new.op)}`"
            yield "boolean_swap", node.lineno, desc, text.splice(*text.span(node), _paren(new))
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value < 10_000:
            for delta in (1, -1):
                if node.value + delta < 0:
                    continue
                desc = f"constant {node.value} became {node.value + delta}"
                yield "off_by_one", node.lineno, desc, text.splice(*text.span(node), str(node.value + delta))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            test = node.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                replacement = _paren(test.operand)
            else:
                replacement = f"not {_paren(test)}"
            desc = "a condition was negated"
            yield "negate_condition", test.lineno, desc, text.splice(*text.span(test), replacement)
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and not any(isinstance(arg, ast.Starred) for arg in node.args[:2])
        ):
            first, second = node.args[0], node.args[1]
            if ast.dump(first) == ast.dump(second):
                continue
            new = copy.deepcopy(node)
            new.args[0], new.args[1] = new.args[1], new.args[0]
            desc = f"the first two arguments of `{ast.unparse(node.func)}` were swapped"
            yield "swap_arguments", node.lineno, desc, text.splice(*text.span(node), ast.unparse(new))


def _statement_candidates(text: _SourceText, function: ast.AST) -> Iterator[tuple[str, int, str, str]]:
    """Mutations that remove a whole statement: a guard clause, or a one-line statement."""
    for statements in _statement_lists(function):
        for index, statement in enumerate(statements):
            if (
                isinstance(statement, ast.If)
                and not statement.orelse
                and len(statement.body) == 1
                and isinstance(statement.body[0], (ast.Return, ast.Raise, ast.Continue, ast.Break))
                and len(statements) > 1
            ):
                start, end = text.line_span(statement.lineno, statement.end_lineno)
                desc = "a guard clause was removed"
                yield "remove_guard", statement.lineno, desc, text.splice(start, end, "")
            elif (
                isinstance(statement, (ast.Assign, ast.AugAssign, ast.Expr))
                and not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))
                and len(statements) > 1
                and index < len(statements) - 1
                and _single_line_owner(text, statement)
            ):
                start, end = text.line_span(statement.lineno, statement.end_lineno)
                desc = "a statement was removed"
                yield "remove_statement", statement.lineno, desc, text.splice(start, end, "")


def _paren(node: ast.AST) -> str:
    return f"({ast.unparse(node)})"


def enumerate_mutations(
    source: str, *, path: str, functions: set[str] | None = None, kinds: tuple[str, ...] = MUTATION_KINDS
) -> list[Mutation]:
    """Every single-site mutation of the given functions (all of them when `functions` is None).

    Mutants that do not compile or leave the text unchanged are dropped; the order is stable, so
    seeded sampling over the result is deterministic.
    """
    unknown = set(kinds) - set(MUTATION_KINDS)
    if unknown:
        raise MutationError(f"unknown mutation kinds {sorted(unknown)}; choose from {MUTATION_KINDS}")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise MutationError(f"{path} does not parse: {exc}") from exc
    text = _SourceText(source)
    mutations: list[Mutation] = []
    seen: set[str] = set()
    for qualname, function in _functions(tree):
        if functions is not None and qualname not in functions:
            continue
        for kind, lineno, description, mutated in _candidates(text, qualname, function):
            if kind not in kinds or mutated == source or mutated in seen:
                continue
            try:
                compile(mutated, path, "exec")
            except SyntaxError:
                continue
            seen.add(mutated)
            mutations.append(
                Mutation(
                    kind=kind,
                    path=path,
                    function=qualname,
                    lineno=lineno,
                    description=description,
                    original_source=source,
                    mutated_source=mutated,
                )
            )
    return mutations
