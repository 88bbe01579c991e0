"""HTML views of the agents app: submit, watch live, browse and compare traces, download patches."""

from __future__ import annotations

from datetime import date

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import HttpResponse, JsonResponse
from django.http.request import split_domain_port
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from sandboxes.tools import TOOL_NAMES
from webapp.agents import selectors, services
from webapp.agents.forms import RepositoryForm, TaskSubmitForm
from webapp.agents.models import AgentTask
from webapp.core.forms import form_add_service_error, message_add_service_error
from webapp.core.selectors import owned_get_for_change
from webapp.core.validation import Range, number_check, text_check

TASK_FORM_FIELD_NAMES = {"team": "share_with_team", "policy_options": "step_delay_s"}
"""task_create's argument names that the submission form calls differently."""


def builtin_base_url_for(request) -> str:
    """This server's /v1 as the submitting client reached it (workers may override via settings).

    Django checks the Host header's name against ALLOWED_HOSTS but not its port, so the port kept is the
    one this server answers on (SERVER_PORT) or the scheme's default: any other would aim the worker, and
    the owner's token, at another local service.
    """
    if settings.AGENT_BUILTIN_BASE_URL:
        return settings.AGENT_BUILTIN_BASE_URL
    name, port = split_domain_port(request.get_host())
    default = "443" if request.is_secure() else "80"
    server_port = str(request.META.get("SERVER_PORT") or default)
    if port not in ("", server_port, default):
        port = server_port
    netloc = name if port in ("", default) else f"{name}:{port}"
    return f"{request.scheme}://{netloc}/v1"


def task_filters_from(params) -> dict:
    """Parse trace-browser filters from a query dict; raise ValueError naming a bad value."""

    def text(name: str) -> str | None:
        return text_check(name, (params.get(name) or "").strip(), max_chars=1000) or None

    def number(name: str) -> float | None:
        raw = text(name)
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw[:60]!r}") from None
        return number_check(name, value, Range())

    def day(name: str) -> date | None:
        raw = text(name)
        if raw is None:
            return None
        try:
            return date.fromisoformat(raw)
        except ValueError:
            raise ValueError(f"{name} must be a date like 2026-01-31, got {raw[:60]!r}") from None

    status = text("status")
    if status and status not in AgentTask.Status.values:
        raise ValueError(f"status must be one of {', '.join(AgentTask.Status.values)}, got {status[:60]!r}")
    outcome = text("outcome")
    if outcome and outcome not in AgentTask.Outcome.values:
        raise ValueError(
            f"outcome must be one of {', '.join(v for v in AgentTask.Outcome.values if v)}, got {outcome[:60]!r}"
        )
    source = text("source")
    if source and source not in AgentTask.Source.values:
        raise ValueError(f"source must be one of {', '.join(AgentTask.Source.values)}, got {source[:60]!r}")
    return {
        "status": status, "outcome": outcome, "source": source, "model": text("model"),
        "repository": text("repository"), "experiment": text("experiment"), "tool": text("tool"),
        "reward_min": number("reward_min"), "reward_max": number("reward_max"),
        "date_from": day("date_from"), "date_to": day("date_to"), "search": text("q"),
    }


@login_required
def task_list(request):
    if request.method == "POST":
        form = TaskSubmitForm(request.POST, request.FILES, user=request.user)
        if form.is_valid():
            try:
                task = services.task_create(owner=request.user, builtin_base_url=builtin_base_url_for(request),
                                            **form.service_arguments())
            except ValidationError as exc:
                form_add_service_error(form, exc, field_names=TASK_FORM_FIELD_NAMES)
            else:
                # Tagged with the state it describes: the live page drops it once the task moves on.
                messages.success(request, f"Task {task.pk} queued.", extra_tags="while-queued")
                return redirect("agents:task-detail", pk=task.pk)
    else:
        form = TaskSubmitForm(user=request.user)
    tasks = selectors.task_list(user=request.user, source=AgentTask.Source.PRODUCT)[:50]
    return render(request, "agents/task_list.html", {
        "form": form, "tasks": tasks, "repository_form": RepositoryForm(user=request.user),
        "repositories": selectors.repository_list(user=request.user),
    })


@login_required
def repository_list(request):
    if request.method == "POST":
        form = RepositoryForm(request.POST, request.FILES, user=request.user)
        if form.is_valid():
            try:
                repository = services.repository_create(owner=request.user, **form.service_arguments())
            except ValidationError as exc:
                form_add_service_error(form, exc, field_names={"team": "share_with_team"})
            else:
                messages.success(request, f"Repository '{repository.name}' registered.")
                return redirect("agents:task-list")
    else:
        form = RepositoryForm(user=request.user)
    return render(request, "agents/repository_list.html", {
        "repository_form": form, "repositories": selectors.repository_list(user=request.user),
    })


@login_required
def task_detail(request, pk: int):
    task = selectors.task_get(user=request.user, pk=pk)
    return render(request, "agents/task_detail.html", {
        "task": task, "can_change": task.owner_id == request.user.pk, "branch": getattr(task, "branch", None),
        "pending_followups": task.followups.filter(status="pending").count(),
        "share_url": request.build_absolute_uri(), "tools_used": selectors.task_tools_used(task=task),
        "index_progress": selectors.task_index_progress(task=task),
    })


@login_required
def task_index_progress(request, pk: int):
    """The semantic index build of the task's snapshot (the task page polls it while building)."""
    task = selectors.task_get(user=request.user, pk=pk)
    return JsonResponse({"progress": selectors.task_index_progress(task=task)})


@login_required
@require_POST
def task_cancel(request, pk: int):
    task = owned_get_for_change(queryset=AgentTask.objects.all(), user=request.user, pk=pk)
    try:
        task = services.task_cancel(task=task, user=request.user)
        if task.is_finished:
            messages.info(request, f"Task {task.pk} cancelled.")
        else:
            messages.info(request, f"Cancellation of task {task.pk} requested.", extra_tags="while-running")
    except ValidationError as exc:
        message_add_service_error(request, exc)
    return redirect("agents:task-detail", pk=pk)


@login_required
def task_patch(request, pk: int):
    task = selectors.task_get(user=request.user, pk=pk)
    response = HttpResponse(task.diff, content_type="text/x-diff; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="flowstate-task-{task.pk}.patch"'
    return response


@login_required
def trace_list(request):
    error = None
    try:
        filters = task_filters_from(request.GET)
    except ValueError as exc:
        error, filters = str(exc), {}
    tasks = selectors.task_list(user=request.user, **filters)
    page = Paginator(tasks, 50).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "agents/trace_list.html", {
        "page": page, "filters": request.GET, "error": error, "statuses": AgentTask.Status.values,
        "outcomes": [choice for choice in AgentTask.Outcome.choices if choice[0]],
        "tools": TOOL_NAMES, "query": query.urlencode(),
    })


@login_required
def trace_compare(request):
    ids = []
    for name in ("a", "b"):
        raw = request.GET.get(name, "")
        if not raw.isdigit():
            messages.error(request, "Pick two traces (A and B) to compare.")
            return redirect("agents:trace-list")
        ids.append(int(raw))
    pair = [selectors.task_get(user=request.user, pk=pk) for pk in ids]
    return render(request, "agents/trace_compare.html", {"left": pair[0], "right": pair[1], "pair": pair})
