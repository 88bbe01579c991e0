"""RL experiments on an imported (registered) model: chosen from a list by who may see it, then run end to end
through the API, a real Celery worker, the monitor and the Ray driver, checkpointed with the model's tokenizer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from tests.training.hf.policy_models import save_policy_directory
from webapp.experiments.forms import ExperimentForm
from webapp.experiments.validation import experiment_config_check
from webapp.registry.services import import_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def policy_source(tmp_path_factory):
    directory = tmp_path_factory.mktemp("imported-exp") / "qwen3-moe-tiny"
    save_policy_directory(directory)
    return directory


@pytest.fixture
def registered(settings, tmp_path, policy_source, owner, team):
    settings.MODELS_ROOT = tmp_path / "models"
    return import_model(source=policy_source, name="team-moe", owner=owner, team=team)


def _config(**changes) -> dict:
    return {"steps": 2, "tasks": 2, "group_size": 2, "groups_per_step": 1, "max_staleness": 0, "rollout_workers": 2,
            "max_turns": 1, "max_tokens_per_turn": 8, "context_tokens": 8192, "ray_num_cpus": 1, **changes}


def test_owner_and_teammate_may_start_from_the_model_outsiders_may_not(registered, owner, teammate, outsider):
    for user in (owner, teammate):
        values = experiment_config_check(_config(policy_model="team-moe", precision="mxfp8"), owner=user)
        assert values["init_checkpoint"] == registered.directory and values["precision"] == "mxfp8"
    with pytest.raises(ValidationError) as refused:
        experiment_config_check(_config(policy_model="team-moe"), owner=outsider)
    assert "no registered model 'team-moe' is visible to you" in str(refused.value.message_dict["policy_model"])
    # A typed server path never stands in for a registered model, nor do both go together.
    with pytest.raises(ValidationError) as typed:
        experiment_config_check(_config(policy_model=registered.directory), owner=owner)
    assert "policy_model" in typed.value.message_dict
    with pytest.raises(ValidationError) as both:
        experiment_config_check(_config(policy_model="team-moe", init_checkpoint="/etc"), owner=owner)
    assert "not both" in str(both.value.message_dict["policy_model"])
    with pytest.raises(ValidationError) as guided:
        experiment_config_check(_config(policy_model="team-moe", expert_guidance=True), owner=owner)
    assert "expert_guidance" in guided.value.message_dict
    with pytest.raises(ValidationError) as precision:
        experiment_config_check(_config(policy_model="team-moe", precision="fp4"), owner=owner)
    assert "precision" in precision.value.message_dict
    # A clone carries the model's own directory as init_checkpoint: accepted.
    clone = {**_config(policy_model="team-moe"), "init_checkpoint": registered.directory}
    assert experiment_config_check(clone, owner=teammate)["init_checkpoint"] == registered.directory


def test_the_launch_form_lists_the_models_the_user_may_use(registered, owner, outsider):
    owner_choices = [value for value, _ in ExperimentForm(user=owner).fields["policy_model"].choices]
    assert owner_choices == ["", "team-moe"]
    assert [value for value, _ in ExperimentForm(user=outsider).fields["policy_model"].choices] == [""]
    posted = {"name": "x", "policy_model": "team-moe", "steps": 2}
    form = ExperimentForm(data=posted, user=outsider)
    assert not form.is_valid() and "policy_model" in form.errors  # not among the outsider's choices
    form = ExperimentForm(data=posted, user=owner)
    assert form.is_valid(), form.errors
    assert form.config()["policy_model"] == "team-moe"


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.django_db(transaction=True)
def test_rl_experiment_on_an_imported_model_runs_through_the_api_and_celery(
    api_client_for, owner, team, settings, tmp_path, policy_source, celery_worker_process
):
    from training.checkpoint import load_checkpoint
    from training.hf.policy import HF_SUBDIR, HFTokenizer
    from training.rollout.config import AsyncRLConfig, update_config_for
    from training.train.learner import Learner
    from webapp.experiments.models import Experiment, ExperimentCheckpoint, ExperimentRollout
    from webapp.experiments.selectors import checkpoint_choices

    settings.STATE_DIR = tmp_path
    settings.MODELS_ROOT = tmp_path / "models"
    import_model(source=policy_source, name="team-moe", owner=owner, team=team)
    api = api_client_for(owner)
    started = time.monotonic()
    created = api.post("/api/experiments/", {"name": "imported", "config": _config(
        policy_model="team-moe", precision="mxfp8")}, format="json")
    assert created.status_code == 201, created.json()
    pk = created.json()["id"]
    _wait(lambda: Experiment.objects.get(pk=pk).status in ("finished", "failed"), 420, "the run to finish")
    experiment = Experiment.objects.get(pk=pk)
    assert experiment.status == "finished", experiment.status_reason
    assert experiment.current_step == 2
    rollouts = ExperimentRollout.objects.filter(experiment=experiment)
    assert rollouts.count() == 4
    checkpoint = Path(experiment.run_dir) / "checkpoints" / "step-00000002"
    assert (checkpoint / HF_SUBDIR / "tokenizer.json").is_file()
    model, tokenizer, _ = load_checkpoint(checkpoint)
    assert isinstance(tokenizer, HFTokenizer) and model.config.precision == "mxfp8"
    # Resumable: the run's learner restores version 2 from it, and the checkpoint is offered by name to
    # start the next run from (never a typed path).
    config = AsyncRLConfig.from_dict({**experiment.config, "run_dir": experiment.run_dir})
    assert Learner(update_config_for(config)).restore(experiment.run_dir)["version"] == 2
    _wait(lambda: ExperimentCheckpoint.objects.filter(experiment=experiment, step=2).exists(), 60, "the checkpoint row")
    name = f"experiment-{pk}-step-2"
    assert checkpoint_choices(user=owner)[name] == str(checkpoint)
    follow_up = experiment_config_check(_config(init_checkpoint=name, steps=1), owner=owner)
    assert follow_up["init_checkpoint"] == str(checkpoint)
    print(f"imported-model experiment: {time.monotonic() - started:.1f} s to finish 2 steps")
