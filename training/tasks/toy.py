"""Toy tier: small generated repositories (a few functions with tests) with one injected bug.

`generate_toy_task(seed)` is a pure function of the seed: the same seed gives the same repository,
bug, prompt and hidden tests on every machine. Expected test values are computed by running the
correct code, and a mutation is kept only if at least one test input exposes it, so every task is
fail-to-pass by construction (the sandbox validation in tests/tasks checks a sample end to end).
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from training.tasks.base import CodingTask, TaskError, minimal_fix_edit
from training.tasks.mutations import enumerate_mutations

# Held-out toy tasks come from their own seed range, so they are never generated for training.
HELDOUT_SEED_OFFSET = 1_000_000_000
TEST_COMMAND = "python3 -m unittest discover -v -s tests -t ."
CASES_PER_FUNCTION = 6


@dataclass(frozen=True)
class _FunctionTemplate:
    names: tuple[str, ...]
    source: str
    make_constants: Callable[[random.Random], dict]
    make_inputs: Callable[[random.Random, dict], tuple]


def _ints(
    rng: random.Random, low: int = -20, high: int = 40, min_len: int = 0, max_len: int = 8
) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(min_len, max_len))]


def _words(rng: random.Random, count: int) -> list[str]:
    vocabulary = ["red", "blue", "green", "tea", "cake", "sun", "moon", "star", "sea", "owl"]
    return [rng.choice(vocabulary) for _ in range(count)]


def _values_and_member(rng: random.Random) -> tuple[list[int], int]:
    values = _ints(rng, 0, 6, 1, 8)
    return values, rng.choice([*values, 99])


def _two_divisors(rng: random.Random) -> dict:
    first = rng.choice([2, 3, 5])
    return {"a": first, "b": rng.choice([other for other in (3, 5, 7) if other != first])}


def _grade_bands(rng: random.Random) -> dict:
    top = rng.choice([80, 85, 90])
    return {"a": top, "b": top - 10, "c": top - 20}


_TEMPLATES: tuple[_FunctionTemplate, ...] = (
    _FunctionTemplate(
        names=("clamp", "bound", "limit_to_range"),
        source='''
            def {name}(value, low, high):
                """Return value limited to the closed interval [low, high]."""
                if value < low:
                    return low
                if value > high:
                    return high
                return value
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (rng.randint(-30, 30), rng.randint(-10, 0), rng.randint(1, 12)),
    ),
    _FunctionTemplate(
        names=("running_total", "prefix_sums", "cumulative"),
        source='''
            def {name}(values):
                """Return the list of prefix sums of values."""
                totals = []
                current = 0
                for value in values:
                    current += value
                    totals.append(current)
                return totals
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (_ints(rng, min_len=1),),
    ),
    _FunctionTemplate(
        names=("count_above", "how_many_exceed", "tally_large"),
        source='''
            def {name}(values, threshold={threshold}):
                """Count the values strictly greater than threshold."""
                count = 0
                for value in values:
                    if value > threshold:
                        count += 1
                return count
        ''',
        make_constants=lambda rng: {"threshold": rng.randint(0, 9)},
        make_inputs=lambda rng, c: (_ints(rng, -5, 20, 2, 9), rng.randint(0, 12)),
    ),
    _FunctionTemplate(
        names=("chunk", "split_into_groups", "batched"),
        source='''
            def {name}(items, size):
                """Split items into consecutive lists of `size` elements (the last may be shorter)."""
                if size <= 0:
                    raise ValueError("size must be positive")
                groups = []
                for start in range(0, len(items), size):
                    groups.append(items[start:start + size])
                return groups
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (_ints(rng, 0, 9, 1, 9), rng.randint(1, 4)),
    ),
    _FunctionTemplate(
        names=("find_index", "position_of", "locate"),
        source='''
            def {name}(values, target):
                """Index of the first occurrence of target in values, or -1."""
                for index in range(len(values)):
                    if values[index] == target:
                        return index
                return -1
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: _values_and_member(rng),
    ),
    _FunctionTemplate(
        names=("is_sorted", "is_ascending", "in_order"),
        source='''
            def {name}(values):
                """True if values never decrease from left to right."""
                for index in range(1, len(values)):
                    if values[index - 1] > values[index]:
                        return False
                return True
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (
            (sorted(_ints(rng, 0, 9, 1, 6)) if rng.random() < 0.5 else _ints(rng, 0, 9, 1, 6)),
        ),
    ),
    _FunctionTemplate(
        names=("unique", "dedupe", "distinct_in_order"),
        source='''
            def {name}(items):
                """Items without repeats, keeping the first occurrence of each."""
                seen = set()
                result = []
                for item in items:
                    if item not in seen:
                        seen.add(item)
                        result.append(item)
                return result
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (_ints(rng, 0, 5, 1, 9),),
    ),
    _FunctionTemplate(
        names=("word_counts", "tally_words", "frequencies"),
        source='''
            def {name}(text, min_length={min_length}):
                """Count words of at least min_length characters, case-insensitively."""
                counts = {{}}
                for word in text.lower().split():
                    if len(word) >= min_length:
                        counts[word] = counts.get(word, 0) + 1
                return counts
        ''',
        make_constants=lambda rng: {"min_length": rng.randint(2, 3)},
        make_inputs=lambda rng, c: (
            " ".join(w.upper() if rng.random() < 0.3 else w for w in _words(rng, rng.randint(1, 8))),
        ),
    ),
    _FunctionTemplate(
        names=("largest_step", "max_gap", "biggest_jump"),
        source='''
            def {name}(values):
                """Largest absolute difference between neighbours; 0 for fewer than two values."""
                best = 0
                for left, right in zip(values, values[1:]):
                    gap = abs(right - left)
                    if gap > best:
                        best = gap
                return best
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (_ints(rng, -9, 30, 0, 7),),
    ),
    _FunctionTemplate(
        names=("rotate_left", "shift_items", "cycle"),
        source='''
            def {name}(items, steps):
                """Rotate items left by steps positions (wrapping around)."""
                if not items:
                    return []
                steps = steps % len(items)
                return items[steps:] + items[:steps]
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (_ints(rng, 0, 9, 0, 7), rng.randint(0, 9)),
    ),
    _FunctionTemplate(
        names=("mean", "average", "safe_mean"),
        source='''
            def {name}(values):
                """Arithmetic mean rounded to {digits} digits; 0.0 for an empty list."""
                if len(values) == 0:
                    return 0.0
                return round(sum(values) / len(values), {digits})
        ''',
        make_constants=lambda rng: {"digits": rng.randint(2, 4)},
        make_inputs=lambda rng, c: (_ints(rng, -10, 50, 0, 7),),
    ),
    _FunctionTemplate(
        names=("label", "fizz_label", "classify_number"),
        source='''
            def {name}(number):
                """"both" if divisible by {a} and {b}, "{a}" or "{b}" if by one of them, else the number."""
                if number % {a} == 0 and number % {b} == 0:
                    return "both"
                if number % {a} == 0:
                    return "{a}"
                if number % {b} == 0:
                    return "{b}"
                return str(number)
        ''',
        make_constants=lambda rng: _two_divisors(rng),
        make_inputs=lambda rng, c: (
            rng.choice(
                [
                    c["a"] * c["b"] * rng.randint(1, 3),
                    c["a"] * rng.randint(1, 9),
                    c["b"] * rng.randint(1, 9),
                    rng.randint(1, 60),
                ]
            ),
        ),
    ),
    _FunctionTemplate(
        names=("digit_sum", "sum_of_digits", "digital_total"),
        source='''
            def {name}(number):
                """Sum of the decimal digits of abs(number)."""
                total = 0
                for digit in str(abs(number)):
                    total += int(digit)
                return total
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (rng.randint(-9999, 99999),),
    ),
    _FunctionTemplate(
        names=("grade", "letter_for", "score_band"),
        source='''
            def {name}(score):
                """Letter grade: A from {a}, B from {b}, C from {c}, otherwise F."""
                if score >= {a}:
                    return "A"
                if score >= {b}:
                    return "B"
                if score >= {c}:
                    return "C"
                return "F"
        ''',
        make_constants=lambda rng: _grade_bands(rng),
        make_inputs=lambda rng, c: (
            rng.choice([c["a"], c["b"], c["c"], c["a"] - 1, c["b"] - 1, rng.randint(0, 100)]),
        ),
    ),
    _FunctionTemplate(
        names=("window_sums", "sliding_totals", "moving_sum"),
        source='''
            def {name}(values, width):
                """Sums of every window of `width` consecutive values."""
                sums = []
                for start in range(len(values) - width + 1):
                    sums.append(sum(values[start:start + width]))
                return sums
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (_ints(rng, 0, 9, 3, 8), rng.randint(1, 3)),
    ),
    _FunctionTemplate(
        names=("caesar", "shift_letters", "rot_text"),
        source='''
            def {name}(text, shift):
                """Shift lowercase letters by `shift` places, wrapping z to a; other characters unchanged."""
                result = []
                for char in text:
                    if "a" <= char <= "z":
                        result.append(chr((ord(char) - ord("a") + shift) % 26 + ord("a")))
                    else:
                        result.append(char)
                return "".join(result)
        ''',
        make_constants=lambda rng: {},
        make_inputs=lambda rng, c: (
            " ".join(_words(rng, rng.randint(1, 3))) + rng.choice(["", "!", "zz"]),
            rng.randint(1, 25),
        ),
    ),
)

_PACKAGES = ("ledger", "toolkit", "helpers", "mathutil", "textkit", "datakit", "stats", "orchard")
_MODULES = ("core", "numbers", "sequences", "strings", "metrics", "utils", "ops", "transforms")


def toy_task_seeds(*, split: str, count: int, start: int = 0) -> list[int]:
    """Seeds of `count` toy tasks of one split; train and held-out ranges never overlap."""
    if split not in ("train", "heldout"):
        raise TaskError(f"split must be 'train' or 'heldout', got {split!r}")
    if count < 0 or start < 0:
        raise TaskError("count and start must be non-negative")
    if split == "train" and start + count > HELDOUT_SEED_OFFSET:
        raise TaskError(f"train seeds end at {HELDOUT_SEED_OFFSET}; ask for fewer tasks")
    base = HELDOUT_SEED_OFFSET if split == "heldout" else 0
    return [base + start + index for index in range(count)]


def _run_function(source: str, name: str, args: tuple) -> tuple[str, object]:
    """("ok", value) or ("raise", "ExcType: message") for one call of freshly executed code."""
    namespace: dict = {}
    try:
        exec(compile(source, "<toy>", "exec"), namespace)  # our own generated code
        return "ok", namespace[name](*args)
    except Exception as exc:  # noqa: BLE001  (the outcome of mutated code is data here, any exception included)
        return "raise", f"{type(exc).__name__}: {exc}"


def _test_file(module_path: str, functions: list[tuple[str, list[tuple[tuple, object]]]]) -> str:
    import_path = module_path[:-3].replace("/", ".")
    lines = [
        "import unittest",
        "",
        f"from {import_path} import {', '.join(name for name, _ in functions)}",
        "",
        "",
    ]
    lines.append(f"class Test{import_path.rsplit('.', 1)[-1].title()}(unittest.TestCase):")
    for name, cases in functions:
        for index, (args, expected) in enumerate(cases):
            call = f"{name}({', '.join(repr(arg) for arg in args)})"
            lines += [
                f"    def test_{name}_{index}(self):",
                f"        self.assertEqual({call}, {expected!r})",
                "",
            ]
    lines += ["", 'if __name__ == "__main__":', "    unittest.main()", ""]
    return "\n".join(lines)


def _toy_function(rng: random.Random, template) -> tuple[str, str, list]:
    """(name, source, test cases) of one function drawn from `template`: up to CASES_PER_FUNCTION distinct
    inputs it returns on, with the values it returns."""
    name = rng.choice(template.names)
    constants = template.make_constants(rng)
    source = textwrap.dedent(template.source).strip("\n").format(name=name, **constants) + "\n"
    cases = []
    seen_args: set[str] = set()
    for _attempt in range(40):
        args = template.make_inputs(rng, constants)
        if repr(args) in seen_args:
            continue
        seen_args.add(repr(args))
        status, value = _run_function(source, name, args)
        if status == "ok":
            cases.append((args, value))
        if len(cases) == CASES_PER_FUNCTION:
            break
    return name, source, cases


def _exposed_mutation(rng: random.Random, source: str, *, path: str, name: str, cases: list):
    """(mutation, its failing cases (index, args, expected, status, value)) of the first mutation of `name`
    that at least one of its cases exposes, in an order drawn kind first; (None, []) when none is."""
    mutations = enumerate_mutations(source, path=path, functions={name})
    # Draw the kind first so that frequent sites (integer constants) do not crowd out the rest.
    by_kind: dict[str, list] = {}
    for mutation in mutations:
        by_kind.setdefault(mutation.kind, []).append(mutation)
    kind_order = sorted(by_kind)
    rng.shuffle(kind_order)
    ordered = []
    for kind in kind_order:
        rng.shuffle(by_kind[kind])
        ordered.extend(by_kind[kind])
    for mutation in ordered:
        failing = []
        for index, (args, expected) in enumerate(cases):
            status, value = _run_function(mutation.mutated_source, name, args)
            if status != "ok" or value != expected:
                failing.append((index, args, expected, status, value))
        if failing and len(failing) < len(cases) + 1:
            return mutation, failing
    return None, []


def _toy_files(
    *,
    package: str,
    module_names: list[str],
    module_sources: dict[str, str],
    functions: list,
    buggy_module: str,
    buggy_name: str,
    mutated_source: str,
    failing_indexes: set[int],
) -> tuple[dict[str, str], dict[str, str], list[str], list[str]]:
    """(the repository's files, the hidden tests, fail_to_pass ids, pass_to_pass ids) of a toy task."""
    files = {
        f"{package}/__init__.py": f'"""{package.split("_")[0].title()} utilities."""\n',
        "tests/__init__.py": "",
        "README.md": f"# {package}\n\nSmall utility package. Run the tests with `{TEST_COMMAND}`.\n",
    }
    hidden_tests: dict[str, str] = {}
    fail_to_pass: list[str] = []
    pass_to_pass: list[str] = []
    for module in module_names:
        path = f"{package}/{module}.py"
        files[path] = mutated_source if module == buggy_module else module_sources[module]
        module_functions = [(name, cases) for mod, name, _, cases in functions if mod == module]
        test_path = f"tests/test_{module}.py"
        hidden_tests[test_path] = _test_file(path, module_functions)
        # The agent sees the tests of the healthy functions only; the buggy one's tests stay hidden.
        visible = [(name, cases) for name, cases in module_functions if name != buggy_name]
        if visible:
            files[test_path] = _test_file(path, visible)
        class_name = f"Test{module.title()}"
        for name, cases in module_functions:
            for index in range(len(cases)):
                test_id = f"tests.test_{module}.{class_name}.test_{name}_{index}"
                if name == buggy_name and index in failing_indexes:
                    fail_to_pass.append(test_id)
                else:
                    pass_to_pass.append(test_id)
    return files, hidden_tests, fail_to_pass, pass_to_pass


def generate_toy_task(seed: int) -> CodingTask:
    """The toy task for `seed`: three functions in two modules, one of them with an injected bug."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise TaskError(f"seed must be a non-negative int, got {seed!r}")
    rng = random.Random(seed)
    package = f"{rng.choice(_PACKAGES)}_{rng.randint(10, 99)}"
    module_names = rng.sample(_MODULES, 2)
    templates = rng.sample(_TEMPLATES, 3)
    placement = [module_names[0], module_names[0], module_names[1]]

    functions = []  # (module, name, source, cases)
    for template, module in zip(templates, placement, strict=True):
        functions.append((module, *_toy_function(rng, template)))

    module_sources = {
        module: "\n\n".join(source for mod, _, source, _ in functions if mod == module)
        for module in module_names
    }
    buggy_index = rng.randrange(3)
    buggy_module, buggy_name, _, buggy_cases = functions[buggy_index]
    module_path = f"{package}/{buggy_module}.py"

    chosen, chosen_failing = _exposed_mutation(
        rng, module_sources[buggy_module], path=module_path, name=buggy_name, cases=buggy_cases
    )
    if chosen is None:
        raise TaskError(f"seed {seed}: no mutation of {buggy_name} is exposed by its tests")

    files, hidden_tests, fail_to_pass, pass_to_pass = _toy_files(
        package=package, module_names=module_names, module_sources=module_sources, functions=functions,
        buggy_module=buggy_module, buggy_name=buggy_name, mutated_source=chosen.mutated_source,
        failing_indexes={item[0] for item in chosen_failing},
    )

    _, args, expected, status, value = chosen_failing[0]
    call = f"{buggy_name}({', '.join(repr(arg) for arg in args)})"
    observed = f"raises `{value}`" if status == "raise" else f"returns `{value!r}`"
    prompt = (
        f"Bug report for the `{package}` package: `{package}.{buggy_module}.{call}` {observed}, "
        f"but it should return `{expected!r}`.\n\n"
        f"Find and fix the bug in the source code. Do not change the tests; the maintainers will run "
        f"the full test suite with `{TEST_COMMAND}`."
    )
    split = "heldout" if seed >= HELDOUT_SEED_OFFSET else "train"
    return CodingTask(
        task_id=f"toy-{seed}",
        tier="toy",
        split=split,
        prompt=prompt,
        files=files,
        hidden_tests=hidden_tests,
        test_command=TEST_COMMAND,
        fail_to_pass=tuple(fail_to_pass),
        pass_to_pass=tuple(pass_to_pass),
        solution=minimal_fix_edit(
            path=module_path, buggy=chosen.mutated_source, fixed=chosen.original_source
        ),
        mutation_kind=chosen.kind,
        mutation_description=chosen.description,
        metadata={"seed": seed, "module": module_path, "function": buggy_name, "line": chosen.lineno,
                  "report_call": call, "report_expected": repr(expected)},
        test_timeout_s=30.0,
    )
