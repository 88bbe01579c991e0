"""The web process reaches the RL driver's code only through its config and run-directory modules."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

WEB_ALLOWED = {"training.rollout.config", "training.rollout.run_dir"}


def _rollout_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "training.rollout":
            names.update(f"training.rollout.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("training.rollout."):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("training.rollout"))
    return names


def test_the_web_app_imports_only_the_rollout_config_and_run_dir_modules():
    root = Path(__file__).resolve().parents[2] / "webapp"
    found = {str(path.relative_to(root)): _rollout_imports(path) for path in root.rglob("*.py")}
    assert any(found.values()), "the web app should import the rollout config and run-dir modules"
    offending = {path: names - WEB_ALLOWED for path, names in found.items() if names - WEB_ALLOWED}
    assert offending == {}


def test_config_and_run_dir_import_neither_the_driver_nor_torch_nor_ray():
    script = (
        "import sys\n"
        "import training.rollout.config, training.rollout.run_dir\n"
        "print(sorted(name for name in ('training.rollout.driver', 'training.rollout.actors', 'torch', 'ray')"
        " if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_driver_module_still_exports_what_it_did_before_the_split():
    from training.rollout import actors, config, driver, run_dir

    assert driver.AsyncRLConfig is config.AsyncRLConfig
    assert driver.update_config_for is config.update_config_for
    assert driver.RolloutServer is actors.RolloutServer
    assert driver.InferenceServer is actors.InferenceServer
    assert driver._edit_file_arguments is actors._edit_file_arguments
    for name in ("METRICS_FILE", "ROLLOUTS_FILE", "STATUS_FILE", "TRACES_DIR", "read_jsonl", "read_status",
                 "checkpointed_version", "run_finished", "trace_path"):
        assert getattr(driver, name) is getattr(run_dir, name)


def test_the_driver_command_line_is_generated_from_the_config_fields(tmp_path):
    """One flag per AsyncRLConfig field, typed from its annotation, its docstring as help; unset flags keep
    the dataclass defaults, so a JSON config plus a few overrides makes the run's config."""
    import dataclasses

    from training.rollout.config import AsyncRLConfig, config_argument_parser, dataclass_field_docs

    parser = config_argument_parser(AsyncRLConfig)
    flags = {action.dest for action in parser._actions} - {"help"}
    assert flags == {item.name for item in dataclasses.fields(AsyncRLConfig)}
    docs = dataclass_field_docs(AsyncRLConfig)
    assert all(docs[name] for name in flags)  # every field documented
    helps = {action.dest: action.help for action in parser._actions}
    assert helps["group_size"] == docs["group_size"]
    args = vars(parser.parse_args(
        ["--steps", "7", "--lr", "3e-5", "--no-copy-constraint", "--time-budget-minutes", "none",
         "--sandbox-backend", "docker"]
    ))
    assert args == {"steps": 7, "lr": 3e-5, "copy_constraint": False, "time_budget_minutes": None,
                    "sandbox_backend": "docker"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "many"])
