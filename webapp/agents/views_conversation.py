"""HTML actions of the task page for follow-ups and branches (forms post here, then back to the task)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from webapp.agents import branches, followups
from webapp.agents.api_conversation import bundle_response
from webapp.agents.models import AgentTask
from webapp.core.selectors import owned_get_for_change


@login_required
@require_POST
def task_followup(request, pk: int):
    task = owned_get_for_change(queryset=AgentTask.objects.all(), user=request.user, pk=pk)
    try:
        followups.followup_send(task=task, user=request.user, message=request.POST.get("message", ""))
    except ValidationError as exc:
        messages.error(request, "; ".join(exc.messages))
    else:
        messages.success(request, "Follow-up sent: the agent continues in the task's workspace.")
    return redirect("agents:task-detail", pk=pk)


@login_required
@require_POST
def task_branch(request, pk: int):
    task = owned_get_for_change(queryset=AgentTask.objects.all(), user=request.user, pk=pk)
    try:
        branch = branches.branch_create(task=task, user=request.user)
    except ValidationError as exc:
        messages.error(request, "; ".join(exc.messages))
    else:
        where = f", pushed to {branch.pushed_to}" if branch.pushed_to else (
            f"; {branch.push_error}" if branch.push_error else " (no push credentials: download the bundle)")
        messages.success(request, f"Branch {branch.name} at {branch.commit[:12]}{where}.")
    return redirect("agents:task-detail", pk=pk)


@login_required
def task_bundle(request, pk: int):
    return bundle_response(user=request.user, pk=pk)
