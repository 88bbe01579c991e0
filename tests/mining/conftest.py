"""A small repository built in the test: a package, its unittest suite and a git history whose later
commits change code and tests together (what history mining reverts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

OPS_V1 = '''def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return low
    return value


def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
'''
OPS_V2 = OPS_V1.replace("        return low\n    return value", "        return high\n    return value")
OPS_V3 = OPS_V2 + '''

def span(values):
    if not values:
        return 0
    return max(values) - min(values)
'''
TEXT = '''def shout(text):
    return text.upper() + "!"


def words(text):
    parts = [part for part in text.split(" ") if part]
    return len(parts)


def initials(name):
    return "".join(part[0] for part in name.split() if part)
'''
TESTS_V1 = '''import unittest

from calc.ops import clamp, mean


class OpsTest(unittest.TestCase):
    def test_clamp_low(self):
        self.assertEqual(clamp(-5, 0, 10), 0)

    def test_clamp_inside(self):
        self.assertEqual(clamp(5, 0, 10), 5)

    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)
'''
TESTS_V2 = TESTS_V1 + '''
    def test_clamp_high(self):
        self.assertEqual(clamp(15, 0, 10), 10)
'''
TESTS_V3 = TESTS_V2.replace("from calc.ops import clamp, mean", "from calc.ops import clamp, mean, span") + '''
    def test_span(self):
        self.assertEqual(span([3, 9, 4]), 6)
        self.assertEqual(span([]), 0)
'''
TEXT_TESTS = '''import unittest

from calc.text import initials, shout, words


class TextTest(unittest.TestCase):
    def test_shout(self):
        self.assertEqual(shout("hi"), "HI!")

    def test_words(self):
        self.assertEqual(words("a  b c"), 3)

    def test_initials(self):
        self.assertEqual(initials("Ada King Lovelace"), "AKL")
'''


def _commit(root: Path, files: dict[str, str], message: str) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "PATH": "/usr/bin:/bin", "HOME": str(root)}
    subprocess.run(["git", "add", "-A"], cwd=root, check=True, env=env)
    subprocess.run(["git", "commit", "-q", "-m", message], cwd=root, check=True, env=env)


def build_small_repository(root: Path) -> Path:
    """calc/ (two modules) with unittest tests, in three commits; the later two fix/add code with tests."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(root)], check=True)
    _commit(root, {"calc/__init__.py": "", "calc/ops.py": OPS_V1, "calc/text.py": TEXT, "tests/__init__.py": "",
                   "tests/test_ops.py": TESTS_V1, "tests/test_text.py": TEXT_TESTS}, "calc: first version")
    _commit(root, {"calc/ops.py": OPS_V2, "tests/test_ops.py": TESTS_V2}, "clamp: values above high")
    _commit(root, {"calc/ops.py": OPS_V3, "tests/test_ops.py": TESTS_V3}, "span")
    return root


@pytest.fixture
def small_repository(tmp_path) -> Path:
    return build_small_repository(tmp_path / "calc-repo")


@pytest.fixture
def shared_set(owner, team, tmp_path):
    """A ready set (one held-out, one train task) shared with the team, stored directly (the mining itself is
    tested in test_mining_flow)."""
    import dataclasses

    from training.tasks.toy import generate_toy_task, toy_task_seeds
    from webapp.agents.models import Repository
    from webapp.experiments.models import RepositoryRecipe
    from webapp.mining.models import MinedTask, TaskSet

    repository = Repository.objects.create(owner=owner, team=team, name="calc", kind="path", location=str(tmp_path))
    RepositoryRecipe.objects.create(repository=repository, status="ready", log="detect: 3 files")
    task_set = TaskSet.objects.create(owner=owner, team=team, name="shared", repository=repository, repo_label="calc",
                                      repo_location=str(tmp_path), status=TaskSet.Status.READY)
    for split in ("heldout", "train"):
        toy = generate_toy_task(toy_task_seeds(split=split, count=1)[0])
        MinedTask.objects.create(task_set=task_set, task_id=toy.task_id, split=split, source="mutation",
                                 path=toy.solution.path, kind=toy.mutation_kind, fail_to_pass=list(toy.fail_to_pass),
                                 prompt=toy.prompt, diff="", task=dataclasses.asdict(toy))
    return repository, task_set
