"""Auto-install: detect, install offline and verify in the local sandbox; failures say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes import get_backend
from sandboxes.base import RepoSource
from training.tasks.autoinstall import InstallError, InstallFailure, InstallRecipe, detect_recipe
from training.tasks.environment import repository_auto_install

TEST_FILE = "import unittest\nfrom adder import add\n\n\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n"


def _write(root: Path, files: dict[str, str]) -> RepoSource:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return RepoSource(kind="path", location=str(root))


PACKAGED = {
    "pyproject.toml": (
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "adder"\nversion = "0.1"\n\n[tool.setuptools.packages.find]\nwhere = ["src"]\n'
    ),
    "src/adder/__init__.py": "def add(a, b):\n    return a + b\n",
    "tests/__init__.py": "",
    "tests/test_add.py": TEST_FILE,
}


def test_packaged_src_layout_installs_offline_and_tests_run(tmp_path):
    result = repository_auto_install(backend=get_backend("local"), source=_write(tmp_path, PACKAGED))
    assert isinstance(result, InstallRecipe), result
    assert (
        result.verified and result.runner == "unittest" and result.tests_ran == 1 and result.tests_passed == 1
    )
    assert result.detected_from == ("pyproject.toml",) and "pip install" in result.setup_commands[0]


def test_missing_dependency_is_reported_at_install(tmp_path):
    files = {**PACKAGED, "requirements.txt": "surely-not-a-package-flowstate==1.0\n"}
    result = repository_auto_install(backend=get_backend("local"), source=_write(tmp_path, files))
    assert isinstance(result, InstallFailure) and result.stage == "install"
    assert "no network" in result.reason and "surely-not-a-package-flowstate" in result.output_tail


def test_pytest_project_without_pytest_in_image_is_reported(tmp_path):
    files = {**PACKAGED, "pytest.ini": "[pytest]\n"}
    result = repository_auto_install(backend=get_backend("local"), source=_write(tmp_path, files))
    assert isinstance(result, InstallFailure)
    assert result.stage == "test" and "pytest" in result.reason


def test_repository_without_tests_fails_detection(tmp_path):
    result = repository_auto_install(
        backend=get_backend("local"), source=_write(tmp_path, {"main.py": "print(1)\n"})
    )
    assert (
        isinstance(result, InstallFailure) and result.stage == "detect" and "no tests found" in result.reason
    )
    with pytest.raises(InstallError, match="does not parse"):
        detect_recipe({"pyproject.toml": "[tool"}, ["pyproject.toml", "test_x.py"])


def test_recipe_is_stored_for_a_registered_repository(owner, tmp_path, settings):
    settings.REPO_SETUP_NETWORK = False
    from webapp.agents.models import Repository
    from webapp.experiments.services import repository_recipe_detect

    _write(tmp_path / "good", PACKAGED)
    good = Repository.objects.create(owner=owner, name="adder", kind="path", location=str(tmp_path / "good"))
    bad = Repository.objects.create(
        owner=owner, name="empty", kind="path", location=str(tmp_path / "good" / "src")
    )
    assert repository_recipe_detect(repository=good).recipe["tests_ran"] == 1
    stored = repository_recipe_detect(repository=bad)
    assert stored.status == "failed" and stored.failure["stage"] == "detect"
    assert good.recipe.status == "ready"
