"""REST API of follow-ups, branches, bundles and push credentials.

Reading follows the task: its owner and teammates see follow-ups and the branch. Changing is the
owner's: a teammate or outsider who sends a follow-up, creates a branch or sets credentials gets 404,
as for every change action. Services' ValidationErrors become 400/409 in webapp.core.api.
"""

from __future__ import annotations

from pathlib import Path

from django.http import FileResponse, Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.agents import branches, followups, selectors
from webapp.agents.models import AgentTask, Repository, RepositoryCredential, TaskBranch, TaskFollowUp
from webapp.core.api import InputSerializer
from webapp.core.selectors import owned_get_for_change


class FollowUpOutput(serializers.ModelSerializer):
    author = serializers.CharField(source="author.username")

    class Meta:
        model = TaskFollowUp
        fields = ("id", "message", "author", "status", "status_reason", "workspace", "created_at", "delivered_at")


class FollowUpInput(InputSerializer):
    message = serializers.CharField(max_length=followups.MAX_MESSAGE_CHARS, trim_whitespace=True)


class BranchOutput(serializers.ModelSerializer):
    bundle_url = serializers.SerializerMethodField()
    patch_url = serializers.SerializerMethodField()

    class Meta:
        model = TaskBranch
        fields = ("name", "base_commit", "commit", "message", "pushed_to", "push_error", "created_at", "bundle_url",
                  "patch_url")

    def get_bundle_url(self, branch) -> str:
        return f"/api/tasks/{branch.task_id}/bundle/"

    def get_patch_url(self, branch) -> str:
        return f"/api/tasks/{branch.task_id}/patch/"


class CredentialsInput(InputSerializer):
    username = serializers.CharField(required=False, allow_blank=True, max_length=200,
                                     help_text="Default x-access-token (GitHub/GitLab token auth).")
    secret = serializers.CharField(max_length=4000, write_only=True, help_text="Token or password; never returned.")


class TaskFollowUpsApi(APIView):
    @extend_schema(responses=FollowUpOutput(many=True), summary="Follow-up messages of a task")
    def get(self, request, pk: int):
        task = selectors.task_get(user=request.user, pk=pk)
        return Response(FollowUpOutput(task.followups.select_related("author"), many=True).data)

    @extend_schema(request=FollowUpInput, responses={202: FollowUpOutput},
                   summary="Send a follow-up: the agent continues the task's conversation and workspace (owner only)")
    def post(self, request, pk: int):
        task = owned_get_for_change(queryset=AgentTask.objects.all(), user=request.user, pk=pk)
        data = FollowUpInput(data=request.data)
        data.is_valid(raise_exception=True)
        followup = followups.followup_send(task=task, user=request.user, message=data.validated_data["message"])
        return Response(FollowUpOutput(followup).data, status=status.HTTP_202_ACCEPTED)


class TaskBranchApi(APIView):
    @extend_schema(responses=BranchOutput, summary="The task's branch, once created")
    def get(self, request, pk: int):
        task = selectors.task_get(user=request.user, pk=pk)
        branch = TaskBranch.objects.filter(task=task).first()
        if branch is None:
            raise Http404("no branch was created for this task")
        return Response(BranchOutput(branch).data)

    @extend_schema(request=None, responses={201: BranchOutput},
                   summary="Commit the task's changes on flowstate/task-<id>; push when the repository has credentials")
    def post(self, request, pk: int):
        task = owned_get_for_change(queryset=AgentTask.objects.all(), user=request.user, pk=pk)
        return Response(BranchOutput(branches.branch_create(task=task, user=request.user)).data,
                        status=status.HTTP_201_CREATED)


def bundle_response(*, user, pk: int) -> FileResponse:
    """The branch's git bundle (``git clone task.bundle`` or ``git fetch task.bundle <branch>``)."""
    task = selectors.task_get(user=user, pk=pk)
    branch = TaskBranch.objects.filter(task=task).first()
    if branch is None or not Path(branch.bundle_path).is_file():
        raise Http404("create the task's branch first")
    return FileResponse(open(branch.bundle_path, "rb"), as_attachment=True,  # FileResponse closes it
                        filename=f"flowstate-task-{task.pk}.bundle", content_type="application/octet-stream")


class TaskBundleApi(APIView):
    @extend_schema(responses={200: {"type": "string", "format": "binary"}}, summary="git bundle of the task's branch")
    def get(self, request, pk: int):
        return bundle_response(user=request.user, pk=pk)


class RepositoryCredentialsApi(APIView):
    @extend_schema(request=CredentialsInput, responses={204: None},
                   summary="Set the push credentials of your git repository (stored encrypted, never shown)")
    def put(self, request, pk: int):
        repository = owned_get_for_change(queryset=Repository.objects.all(), user=request.user, pk=pk)
        data = CredentialsInput(data=request.data)
        data.is_valid(raise_exception=True)
        branches.credentials_set(repository=repository, user=request.user, **data.validated_data)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses={204: None}, summary="Forget the push credentials of your repository")
    def delete(self, request, pk: int):
        repository = owned_get_for_change(queryset=Repository.objects.all(), user=request.user, pk=pk)
        RepositoryCredential.objects.filter(repository=repository).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)
