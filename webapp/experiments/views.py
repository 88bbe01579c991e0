"""Pages of the experiments app: parse the request, call one service or selector, render."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.core.forms import form_add_service_error, message_add_service_error
from webapp.core.validation import text_check
from webapp.experiments import services
from webapp.experiments.forms import BenchmarkRunForm, EvaluateForm, ExperimentForm
from webapp.experiments.models import ExperimentCheckpoint
from webapp.experiments.selectors import (
    DASHBOARD_SERIES,
    benchmark_leaderboard,
    benchmark_suites,
    compare_ids_check,
    experiment_comparison,
    experiment_dashboard_series,
    experiment_get,
    experiment_get_for_change,
    experiment_group_rollouts,
    experiment_groups,
    experiment_list,
)


def _launch(request, *, form: ExperimentForm, parent=None):
    team = form.cleaned_data.get("share_with_team")
    try:
        if parent is not None:
            experiment = services.experiment_clone(
                experiment=parent, owner=request.user, name=form.cleaned_data["name"], changes=form.config(), team=team
            )
        else:
            experiment = services.experiment_create(
                owner=request.user, name=form.cleaned_data["name"], config=form.config(), team=team
            )
    except ValidationError as error:
        form_add_service_error(form, error, field_names={"team": "share_with_team"})
        return None
    messages.success(request, f"Experiment {experiment.name} queued.")
    return redirect("experiments:experiment-detail", pk=experiment.pk)


@login_required
def experiment_list_view(request):
    form = ExperimentForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        response = _launch(request, form=form)
        if response is not None:
            return response
    status = 400 if request.method == "POST" else 200
    return render(
        request,
        "experiments/experiment_list.html",
        {"form": form, "experiments": experiment_list(user=request.user)[:100]},
        status=status,
    )


@login_required
def experiment_compare_view(request):
    """Two or more experiments' curves on one plot (?ids=1&ids=2), x-axis step or minutes, with the
    config fields that differ; ids the user may not see are a 404."""
    try:
        ids = compare_ids_check(request.GET.getlist("ids"))
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
        return render(request, "experiments/experiment_compare.html", {"comparison": None}, status=400)
    comparison = experiment_comparison(user=request.user, ids=ids)
    return render(request, "experiments/experiment_compare.html", {"comparison": comparison})


@login_required
def experiment_clone_view(request, pk: int):
    source = experiment_get(user=request.user, pk=pk)
    form = ExperimentForm(
        request.POST or None,
        user=request.user,
        initial_config=source.config,
        initial={"name": f"{source.name} (clone)", "share_with_team": source.team_id},
    )
    if request.method == "POST" and form.is_valid():
        response = _launch(request, form=form, parent=source)
        if response is not None:
            return response
    status = 400 if request.method == "POST" else 200
    return render(
        request, "experiments/experiment_clone.html", {"form": form, "source": source}, status=status
    )


@login_required
def experiment_detail_view(request, pk: int):
    experiment = experiment_get(user=request.user, pk=pk)
    return render(
        request,
        "experiments/experiment_detail.html",
        {
            "experiment": experiment,
            "can_change": experiment.owner_id == request.user.pk,
            "series": experiment_dashboard_series(experiment=experiment),
            "series_labels": dict(DASHBOARD_SERIES),
            "groups": experiment_groups(experiment=experiment),
            "checkpoints": experiment.checkpoints.all(),
            "evaluate_form": EvaluateForm(user=request.user),
            "action_states": {name: " ".join(states) for name, states in services.EXPERIMENT_ACTION_STATES.items()},
        },
    )


def _control(request, pk: int, action):
    experiment = experiment_get_for_change(user=request.user, pk=pk)
    try:
        action(experiment=experiment)
    except ValidationError as error:
        message_add_service_error(request, error)
    return redirect("experiments:experiment-detail", pk=experiment.pk)


@login_required
@require_POST
def experiment_pause_view(request, pk: int):
    return _control(request, pk, services.experiment_pause)


@login_required
@require_POST
def experiment_resume_view(request, pk: int):
    return _control(request, pk, services.experiment_resume)


@login_required
@require_POST
def experiment_cancel_view(request, pk: int):
    return _control(request, pk, services.experiment_cancel)


@login_required
def experiment_group_view(request, pk: int, group_id: str):
    experiment = experiment_get(user=request.user, pk=pk)
    if "\x00" in group_id:  # no group id holds one, and PostgreSQL refuses it in a query
        raise Http404
    rollouts = experiment_group_rollouts(experiment=experiment, group_id=group_id)
    if not rollouts:
        raise Http404
    return render(
        request,
        "experiments/group_detail.html",
        {
            "experiment": experiment,
            "group_id": group_id,
            "rollouts": rollouts,
            "step": rollouts[0].step,
            "task_id": rollouts[0].task_id,
            "abandoned": rollouts[0].abandoned,
        },
    )


@login_required
@require_POST
def checkpoint_evaluate_view(request, pk: int, checkpoint_pk: int):
    experiment = experiment_get_for_change(user=request.user, pk=pk)
    checkpoint = get_object_or_404(ExperimentCheckpoint, pk=checkpoint_pk, experiment=experiment)
    form = EvaluateForm(request.POST, user=request.user)
    if not form.is_valid():
        messages.error(request, "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items()))
        return redirect("experiments:experiment-detail", pk=experiment.pk)
    try:
        run = services.benchmark_run_create(
            owner=request.user,
            team=experiment.team,
            suite=form.cleaned_data["suite"],
            policy=f"checkpoint:{checkpoint.path}",
            attempts=form.cleaned_data["attempts"],
            checkpoint=checkpoint,
        )
    except ValidationError as error:
        message_add_service_error(request, error)
        return redirect("experiments:experiment-detail", pk=experiment.pk)
    messages.success(request, f"Evaluation {run.pk} of step {checkpoint.step} on {run.suite} queued.")
    return redirect("experiments:benchmarks")


@login_required
def benchmark_leaderboard_view(request):
    try:
        suite = text_check("suite", request.GET.get("suite") or "", max_chars=100) or None
    except ValueError as exc:
        messages.error(request, str(exc))
        suite = None
    run_form = BenchmarkRunForm(user=request.user)
    task_set_suites = [name for name, _ in run_form.fields["suite"].choices]
    return render(
        request,
        "experiments/leaderboard.html",
        {
            "runs": benchmark_leaderboard(user=request.user, suite=suite),
            "suites": sorted(set(benchmark_suites(user=request.user)) | set(task_set_suites)),
            "suite": suite,
            "run_form": run_form,
        },
    )


@login_required
@require_POST
def benchmark_run_view(request):
    """Queue a benchmark of a task set the user may see (the leaderboard's form)."""
    form = BenchmarkRunForm(request.POST, user=request.user)
    if not form.is_valid():
        messages.error(request, "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items()))
        return redirect("experiments:benchmarks")
    try:
        run = services.benchmark_run_create(owner=request.user, suite=form.cleaned_data["suite"],
                                            policy=form.policy_spec(), attempts=form.cleaned_data["attempts"])
    except ValidationError as error:
        message_add_service_error(request, error)
        return redirect("experiments:benchmarks")
    messages.success(request, f"Benchmark run {run.pk} on {run.suite} queued.")
    return redirect("experiments:benchmarks")
