"""Issue 50's comparison machinery: the paired statistics, the hand-written SVG plot, the recipes' configs,
the loop's time budget, and (slow) a recipe end to end at a tiny budget in real sandboxes."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from training.bench.paired import mcnemar_exact, paired_bootstrap, paired_comparison, per_task_rates
from training.bench.recipes import RecipeConfig, rl_config
from training.bench.runner import BenchConfigError
from training.bench.svg_plot import line_plot_svg


def _rows(passes: list[int], attempts: int = 4) -> list[dict]:
    return [{"task_id": f"toy-{i}", "attempts": attempts, "passes": c} for i, c in enumerate(passes)]


def test_paired_bootstrap_brackets_the_mean_and_narrows_with_agreement():
    pairs = [(0.0, 1.0)] * 30 + [(1.0, 1.0)] * 50 + [(1.0, 0.0)] * 20
    mean, low, high = paired_bootstrap(pairs, resamples=4000, seed=1)
    assert mean == pytest.approx(0.1)
    assert low < 0.1 < high
    # Normal approximation of the same paired mean: sd of d over sqrt(n).
    sd = math.sqrt((30 * 0.9**2 + 50 * 0.1**2 + 20 * 1.1**2) / 99)
    assert high - low == pytest.approx(2 * 1.96 * sd / 10, rel=0.15)
    same = [(1.0, 1.0)] * 40 + [(0.0, 0.0)] * 60  # identical outcomes: no spread at all
    assert paired_bootstrap(same, resamples=500) == (0.0, 0.0, 0.0)
    assert paired_bootstrap(pairs, resamples=500, seed=3) == paired_bootstrap(pairs, resamples=500, seed=3)
    with pytest.raises(BenchConfigError, match="at least 2 tasks"):
        paired_bootstrap([(0.0, 1.0)])


def test_mcnemar_exact_matches_the_binomial_tail():
    assert mcnemar_exact([(1.0, 1.0), (0.0, 0.0)]) == 1.0
    # 8 discordant tasks all one way: p = 2 * 0.5**8
    assert mcnemar_exact([(0.0, 1.0)] * 8 + [(1.0, 1.0)] * 5) == pytest.approx(2 / 256)
    # 6 against 4: two-sided exact p = 2 * P(X <= 4 | n=10, 1/2) = 0.754
    assert mcnemar_exact([(0.0, 1.0)] * 6 + [(1.0, 0.0)] * 4) == pytest.approx(0.75390625)


def test_paired_comparison_of_per_task_rows():
    before = _rows([0, 1, 2, 4, 0, 3])
    after = _rows([2, 1, 4, 4, 0, 4])
    pass1, pass4 = paired_comparison(before, after, k=4, resamples=2000)
    assert pass1.metric == "pass@1" and pass1.tasks == 6
    assert pass1.a == pytest.approx(10 / 24) and pass1.b == pytest.approx(15 / 24)
    assert pass1.low <= pass1.difference <= pass1.high and pass1.mcnemar_p is None
    assert pass4.metric == "pass@4" and pass4.a == pytest.approx(4 / 6) and pass4.b == pytest.approx(5 / 6)
    assert pass4.mcnemar_p == pytest.approx(1.0)  # one discordant task
    # Tasks missing or unscored on one side are left out of the pairing.
    partial = _rows([1, 1, 1])
    partial[1]["attempts"] = 0
    assert len(per_task_rates(partial, after, k=1)) == 2


def test_svg_plot_draws_one_polyline_per_series_and_refuses_nan():
    svg = line_plot_svg({"rl": [[0, 0.5], [30, 0.6], [60, 0.7]], "sft <b>": [[0, 0.5], [60, None]]},
                        title="t", x_label="minutes", y_label="pass@1")
    assert svg.startswith("<svg") and svg.count('class="series"') == 2
    assert "sft &lt;b&gt;" in svg and "<b>" not in svg
    with pytest.raises(ValueError, match="finite"):
        line_plot_svg({"x": [[0, float("nan")]]}, title="t", x_label="x", y_label="y")


def test_recipe_config_checks_and_the_documented_rl_recipe(tmp_path, policy_checkpoint):
    with pytest.raises(ValueError, match="recipe"):
        RecipeConfig(recipe="ppo", init_checkpoint=policy_checkpoint, run_dir=str(tmp_path), minutes=1)
    for minutes in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="minutes"):
            RecipeConfig(recipe="rl", init_checkpoint=policy_checkpoint, run_dir=str(tmp_path), minutes=minutes)
    with pytest.raises(ValueError, match="checkpoint"):
        RecipeConfig(recipe="rl", init_checkpoint=str(tmp_path / "absent"), run_dir=str(tmp_path), minutes=1)
    config = rl_config(RecipeConfig(recipe="rl", init_checkpoint=policy_checkpoint, run_dir=str(tmp_path),
                                    minutes=60, seed=2, rl_options={"rollout_workers": 2}))
    # models/demo/README.md's run-56 command, with this budget and seed.
    assert (config.lr, config.group_size, config.temperature, config.entropy_coef, config.gain_lr_scale) == (
        3e-5, 16, 1.4, -0.5, 100.0)
    assert config.time_budget_minutes == 60 and config.seed == 2 and config.rollout_workers == 2


def test_a_finished_recipe_is_saved_and_reused_only_with_the_same_settings(tmp_path, policy_checkpoint):
    from training.bench.recipes import CurvePoint, RecipeRun, recipe_load, recipe_save

    config = RecipeConfig(recipe="rft", init_checkpoint=policy_checkpoint, run_dir=str(tmp_path), minutes=60)
    assert recipe_load(config) is None
    run = RecipeRun(config=config, final_checkpoint="/c/final", minutes=61.5, steps=2,
                    curve=[CurvePoint(minutes=30.0, checkpoint="/c/1", step=1, pass_at_1=0.5)],
                    rows=[{"step": 1, "loss": 1.0, "minutes": 29.0}, {"step": 2, "loss": 0.9, "minutes": 61.0}],
                    data={"tried": 40, "trajectories": 12})
    recipe_save(run)
    assert recipe_load(config) == run
    other = RecipeConfig(recipe="rft", init_checkpoint=policy_checkpoint, run_dir=str(tmp_path), minutes=30)
    with pytest.raises(ValueError, match="other settings"):
        recipe_load(other)


def test_the_loop_stops_at_its_time_budget(tmp_path, policy_checkpoint):
    from training.train.loop import LoopConfig, OptimizerConfig, TrainConfigError
    from training.train.sft import SFTConfig, sft

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(TrainConfigError, match="time_budget_s"):
            LoopConfig(time_budget_s=bad)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": "done"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join('{"messages": ' + __import__("json").dumps(messages) + "}\n" for _ in range(4)))
    started = time.monotonic()
    result = sft(SFTConfig(run_dir=str(tmp_path / "run"), init_checkpoint=policy_checkpoint, jsonl_files=(str(data),),
                           max_seq_len=2048, loop=LoopConfig(steps=100_000, batch_size=2, micro_batch_size=2,
                                                             checkpoint_every=0, time_budget_s=2.0,
                                                             optimizer=OptimizerConfig(lr=1e-4, warmup_steps=0))))
    assert 1 <= len(result.history) < 100_000
    # Every step but the last began before the 2-second deadline (whatever the machine's load).
    assert sum(row["step_seconds"] for row in result.history[:-1]) < 2.0
    assert time.monotonic() - started < 600
    assert result.final_checkpoint is not None and Path(result.final_checkpoint).name.endswith(
        f"{len(result.history):08d}")


@pytest.mark.slow
def test_expert_sft_recipe_end_to_end_at_a_tiny_budget(tmp_path, policy_checkpoint):
    """Two rounds of fresh expert trajectories + SFT in real sandboxes, ~20 s: curve points and step rows."""
    from training.bench.recipes import run_recipe

    run = run_recipe(RecipeConfig(recipe="expert-sft", init_checkpoint=policy_checkpoint, run_dir=str(tmp_path),
                                  minutes=0.4, curve_points=2, workers=2, max_seq_len=2048))
    assert run.data["trajectories"] >= 2 and len(run.curve) == 2
    assert run.steps == len(run.rows) >= 2
    assert [row["step"] for row in run.rows] == list(range(1, run.steps + 1))
    assert all(row["minutes"] > 0 for row in run.rows) and run.minutes < 3
    assert (Path(run.final_checkpoint) / "model.safetensors").is_file()


def _bench_script():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rl_vs_sft.py"
    spec = importlib.util.spec_from_file_location("bench_rl_vs_sft", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_rl_vs_sft"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return path, module


def test_results_of_separate_runs_are_combined_only_with_the_same_evaluation_settings(tmp_path):
    """A recipe evaluated in one run and another evaluated later are paired from their result.json files; a result
    evaluated with a different temperature is refused by name, not silently compared."""
    import argparse
    import json
    import subprocess
    import sys

    path, bench = _bench_script()
    start = tmp_path / "start"
    start.mkdir()
    settings = {"init_checkpoint": str(start), "minutes": 60.0, "heldout": 4, "attempts": 4, "curve_heldout": 0,
                "max_turns": 5, "max_tokens_per_turn": 96, "temperature": 0.8}
    args = argparse.Namespace(**settings)
    baseline = {"config": {"suite": "toy-heldout-4", "policy": f"checkpoint:{start}", "attempts": 4, "max_turns": 5,
                           "temperature": 0.8, "max_tokens_per_turn": 96, "copy_constraint": True},
                "pass_at_1": 0.25, "pass_at_k": 0.5, "per_task": _rows([0, 0, 2, 2])}
    (tmp_path / "baseline.json").write_text(json.dumps(baseline))
    files = []
    for recipe, passes in (("rl", [4, 4, 2, 2]), ("expert-sft", [0, 4, 2, 2])):
        rows = _rows(passes)
        final = bench.Evaluation(name=recipe, checkpoint="x", pass_at_1=sum(passes) / 16, pass_at_k=1.0, per_task=rows)
        result = bench.RecipeResult(recipe=recipe, seed=0, minutes=60.2, steps=7, final=final, curve=[[0.0, 0.25]])
        files.append(tmp_path / f"{recipe}.json")
        bench.result_save(result, files[-1], args)
        assert bench.result_load(files[-1], args) == result
    command = [sys.executable, str(path), "--combine", *map(str, files), "--baseline", str(tmp_path / "baseline.json"),
               "--init-checkpoint", str(start), "--heldout", "4", "--curve-heldout", "0", "--resamples", "200",
               "--max-tokens-per-turn", "96", "--run-dir", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "combined_report.json").read_text())
    pairs = {(row["a"], row["b"]): row["differences"][0] for row in report["comparisons"]}
    assert pairs[("start", "rl-seed0")]["difference"] == pytest.approx(0.75 - 0.25)
    assert pairs[("rl-seed0", "expert-sft-seed0")]["difference"] == pytest.approx(0.5 - 0.75)
    assert pairs[("start", "expert-sft-seed0")]["tasks"] == 4

    settings["temperature"] = 1.0
    bench.result_save(result, files[-1], argparse.Namespace(**settings))
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "temperature" in refused.stderr
