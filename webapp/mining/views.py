"""Pages of the mining app: repositories' environments, task sets, their tasks and export."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import StreamingHttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from webapp.agents import selectors as agent_selectors
from webapp.agents.models import Repository
from webapp.core.forms import form_add_service_error
from webapp.core.selectors import owned_get_for_change
from webapp.experiments.models import RepositoryRecipe
from webapp.mining import presenters, selectors, services
from webapp.mining.forms import MineForm, RecipeForm


@login_required
def mining_home(request):
    repositories = list(agent_selectors.repository_list(user=request.user))
    recipes = {r.repository_id: r for r in RepositoryRecipe.objects.filter(repository__in=repositories)}
    rows = [(repo, recipes.get(repo.pk)) for repo in repositories]
    return render(request, "mining/home.html", {"rows": rows, "task_sets": selectors.task_set_list(user=request.user)[:100]})


def _recipe_initial(recipe) -> dict:
    data = recipe.recipe if recipe and recipe.recipe else {}
    return {"setup_commands": "\n".join(data.get("setup_commands") or ()), "test_command": data.get("test_command", ""),
            "runner": data.get("runner", "pytest")}


def _environment_page(request, repository, *, recipe_form=None, mine_form=None, status: int = 200):
    recipe = selectors.repository_recipe(repository=repository)
    return render(request, "mining/repository.html", {
        "repository": repository, "recipe": recipe, "state": presenters.environment_state(recipe),
        "recipe_form": recipe_form or RecipeForm(initial=_recipe_initial(recipe)),
        "mine_form": mine_form or MineForm(user=request.user, initial={"name": f"{repository.name} tasks"}),
        "is_owner": repository.owner_id == request.user.pk,
    }, status=status)


@login_required
def repository_environment(request, pk: int):
    repository = agent_selectors.repository_get(user=request.user, pk=pk)
    if request.method != "POST":
        return _environment_page(request, repository)
    repository = owned_get_for_change(queryset=Repository.objects.all(), user=request.user, pk=pk)
    mine_form = MineForm(request.POST, user=request.user)
    if mine_form.is_valid():
        try:
            task_set = services.task_set_create(
                owner=request.user, repository=repository, name=mine_form.cleaned_data["name"],
                settings_values=mine_form.settings_values(), team=mine_form.cleaned_data.get("share_with_team"))
        except ValidationError as error:
            form_add_service_error(mine_form, error, field_names={"team": "share_with_team"})
        else:
            messages.success(request, f"Mining {task_set.name} queued.")
            return redirect("mining:task-set-detail", pk=task_set.pk)
    return _environment_page(request, repository, mine_form=mine_form, status=400)


@login_required
@require_POST
def repository_setup(request, pk: int):
    repository = owned_get_for_change(queryset=Repository.objects.all(), user=request.user, pk=pk)
    edited = None
    form = RecipeForm(request.POST)
    if request.POST.get("action") == "save":
        # A recipe that cannot be saved comes back in the form with its errors: nothing typed is lost.
        if form.is_valid() and not form.cleaned_data["test_command"].strip():
            form.add_error("test_command", "give the command that runs the tests, or press \"Detect and set up\"")
        if form.is_valid():
            try:
                edited = services.recipe_edited_parse(**form.cleaned_data)
            except ValidationError as error:
                form_add_service_error(form, error)
        if not form.is_valid():
            return _environment_page(request, repository, recipe_form=form, status=400)
    try:
        services.repository_setup_request(repository=repository, edited_recipe=edited)
    except ValidationError as error:
        messages.error(request, "; ".join(error.messages))
    else:
        messages.success(request, "Setup queued" + (" with your recipe." if edited else " (detecting the recipe)."),
                         extra_tags="while-pending")
    return redirect("mining:repository", pk=pk)


def _progress_context(request, task_set) -> dict:
    return {"task_set": task_set, "is_owner": task_set.owner_id == request.user.pk,
            "counts": presenters.task_set_counts(task_set), "elapsed_s": presenters.task_set_elapsed_s(task_set),
            "next_step": presenters.task_set_next_step(task_set)}


@login_required
def task_set_detail(request, pk: int):
    task_set = selectors.task_set_get(user=request.user, pk=pk)
    return render(request, "mining/task_set.html", {
        **_progress_context(request, task_set), "tasks": task_set.tasks.all(),
        "rates": selectors.task_set_solve_rates(user=request.user, task_set=task_set),
    })


@login_required
def task_set_progress(request, pk: int):
    """The progress fragment the page polls; a finished set's fragment has no Cancel and stops polling."""
    task_set = selectors.task_set_get(user=request.user, pk=pk)
    return render(request, "mining/_progress.html", _progress_context(request, task_set))


@login_required
@require_POST
def task_set_cancel(request, pk: int):
    task_set = selectors.task_set_get_for_change(user=request.user, pk=pk)
    try:
        services.task_set_cancel(task_set=task_set)
    except ValidationError as error:
        messages.error(request, "; ".join(error.messages))
    return redirect("mining:task-set-detail", pk=pk)


@login_required
def mined_task_detail(request, pk: int, task_pk: int):
    task_set = selectors.task_set_get(user=request.user, pk=pk)
    task = selectors.mined_task_get(task_set=task_set, pk=task_pk)
    rates = selectors.task_set_solve_rates(user=request.user, task_set=task_set).get(task.task_id, {})
    return render(request, "mining/task.html", {"task_set": task_set, "task": task, "rates": rates})


@login_required
def task_set_export(request, pk: int):
    task_set = selectors.task_set_get(user=request.user, pk=pk)
    split = request.GET.get("split") if request.GET.get("split") in ("train", "heldout") else None
    response = StreamingHttpResponse(selectors.task_set_export_lines(task_set=task_set, split=split),
                                     content_type="application/x-ndjson")
    response["Content-Disposition"] = f'attachment; filename="taskset-{task_set.pk}{"-" + split if split else ""}.jsonl"'
    return response
