"""REST API of the agents app: parse input, call one service or selector, format the output."""

from __future__ import annotations

import json

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.agents import selectors, services
from webapp.agents.models import AgentTask, Repository, TaskEvent
from webapp.agents.views import builtin_base_url_for, task_filters_from


def _drf_error(exc: DjangoValidationError) -> ValidationError:
    return ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages})


class RepositoryOutput(serializers.ModelSerializer):
    class Meta:
        model = Repository
        fields = ("id", "name", "kind", "location", "ref", "description", "created_at")


class RepositoryInput(serializers.Serializer):
    name = serializers.CharField(max_length=120)
    kind = serializers.ChoiceField(choices=["git", "archive"])
    location = serializers.CharField(required=False, allow_blank=True, help_text="Git URL (kind=git).")
    ref = serializers.CharField(required=False, allow_blank=True)
    description = serializers.CharField(required=False, allow_blank=True)
    archive = serializers.FileField(required=False, help_text=".tar.gz, .tgz, .tar or .zip (kind=archive).")


class TaskOutput(serializers.ModelSerializer):
    repository = serializers.CharField(source="repo_label")
    owner = serializers.CharField(source="owner.username")
    verdict = serializers.CharField(read_only=True, help_text="finished, tests pass / tests fail / no tests; failed (why)")
    events_url = serializers.SerializerMethodField()
    patch_url = serializers.SerializerMethodField()
    websocket_path = serializers.SerializerMethodField()

    class Meta:
        model = AgentTask
        fields = (
            "id", "public_id", "source", "owner", "repository", "repo_kind", "prompt", "backend", "model_name",
            "limits", "policy_options", "status", "status_reason", "outcome", "verdict", "test_command", "test_summary",
            "test_output", "attempt", "last_seq", "created_at",
            "started_at", "finished_at", "final_message", "turns", "prompt_tokens", "completion_tokens",
            "experiment_name", "training_step", "reward", "advantage", "events_url", "patch_url", "websocket_path",
        )

    def get_events_url(self, task) -> str:
        return f"/api/tasks/{task.pk}/events/"

    def get_patch_url(self, task) -> str:
        return f"/api/tasks/{task.pk}/patch/"

    def get_websocket_path(self, task) -> str:
        return f"/ws/tasks/{task.pk}/events/"


class JSONObjectField(serializers.JSONField):
    """A JSON object given as JSON (application/json) or as a JSON string (multipart forms)."""

    def to_internal_value(self, data):
        if isinstance(data, str):
            try:
                data = json.loads(data) if data.strip() else {}
            except ValueError as exc:
                raise serializers.ValidationError(f"not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be a JSON object")
        return data


class TaskInput(serializers.Serializer):
    prompt = serializers.CharField(max_length=20000)
    backend = serializers.ChoiceField(choices=AgentTask.Backend.values)
    repository_id = serializers.IntegerField(required=False, help_text="A registered repository you may see.")
    git_url = serializers.CharField(required=False, allow_blank=True)
    git_ref = serializers.CharField(required=False, allow_blank=True)
    archive = serializers.FileField(required=False, help_text="Upload instead of a repository or git URL.")
    model_name = serializers.CharField(required=False, allow_blank=True, help_text="backend=openai only.")
    base_url = serializers.CharField(required=False, allow_blank=True, help_text="backend=openai only.")
    api_key = serializers.CharField(required=False, allow_blank=True, write_only=True, help_text="backend=openai only; never returned.")
    limits = JSONObjectField(required=False, help_text="AgentLimits fields, e.g. {\"max_turns\": 20}.")
    policy_options = JSONObjectField(required=False, help_text="scripted: {\"step_delay_s\": 0.5}; others: {\"seed\": 1}.")
    share_with_team = serializers.CharField(required=False, allow_blank=True, help_text="Name of one of your teams.")


class EventOutput(serializers.Serializer):
    seq = serializers.IntegerField()
    kind = serializers.CharField()
    turn = serializers.IntegerField()
    ts = serializers.FloatField()
    attempt = serializers.IntegerField()
    payload = serializers.JSONField()
    has_full_output = serializers.BooleanField()


def _team_for(user, name: str):
    if not name:
        return None
    team = user.teams.filter(name=name).first()
    if team is None:
        raise ValidationError({"share_with_team": [f"you are not a member of a team named '{name}'"]})
    return team


class RepositoryListApi(APIView):
    parser_classes = (JSONParser, MultiPartParser, FormParser)

    @extend_schema(responses=RepositoryOutput(many=True), summary="Repositories you may use")
    def get(self, request):
        return Response(RepositoryOutput(selectors.repository_list(user=request.user), many=True).data)

    @extend_schema(request=RepositoryInput, responses={201: RepositoryOutput}, summary="Register a repository")
    def post(self, request):
        data = RepositoryInput(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            repo = services.repository_create(owner=request.user, **data.validated_data)
        except DjangoValidationError as exc:
            raise _drf_error(exc) from exc
        return Response(RepositoryOutput(repo).data, status=status.HTTP_201_CREATED)


class TaskListApi(APIView):
    parser_classes = (JSONParser, MultiPartParser, FormParser)

    @extend_schema(
        responses=TaskOutput(many=True), summary="Tasks and rollouts you may see",
        parameters=[OpenApiParameter(name, str, required=False) for name in
                    ("status", "outcome", "source", "model", "repository", "experiment", "tool", "reward_min", "reward_max",
                     "date_from", "date_to", "q")],
    )
    def get(self, request):
        try:
            filters = task_filters_from(request.query_params)
        except ValueError as exc:
            raise ValidationError({"detail": str(exc)}) from exc
        tasks = selectors.task_list(user=request.user, **filters)
        from rest_framework.pagination import LimitOffsetPagination

        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(tasks, request, view=self)
        return paginator.get_paginated_response(TaskOutput(page, many=True).data)

    @extend_schema(request=TaskInput, responses={201: TaskOutput}, summary="Submit a coding task")
    def post(self, request):
        data = TaskInput(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        repository = None
        if "repository_id" in values:
            try:
                repository = selectors.repository_get(user=request.user, pk=values.pop("repository_id"))
            except Http404:
                raise ValidationError({"repository_id": ["no repository with this id is visible to you"]}) from None
        team = _team_for(request.user, values.pop("share_with_team", ""))
        try:
            task = services.task_create(owner=request.user, repository=repository, team=team,
                                        builtin_base_url=builtin_base_url_for(request), **values)
        except DjangoValidationError as exc:
            raise _drf_error(exc) from exc
        return Response(TaskOutput(task).data, status=status.HTTP_201_CREATED)


class TaskDetailApi(APIView):
    @extend_schema(responses=TaskOutput, summary="One task or rollout")
    def get(self, request, pk: int):
        return Response(TaskOutput(selectors.task_get(user=request.user, pk=pk)).data)


class TaskCancelApi(APIView):
    @extend_schema(request=None, responses=TaskOutput, summary="Cancel a queued or running task (owner only)")
    def post(self, request, pk: int):
        from webapp.core.selectors import owned_get_for_change

        task = owned_get_for_change(queryset=AgentTask.objects.all(), user=request.user, pk=pk)
        try:
            task = services.task_cancel(task=task, user=request.user)
        except DjangoValidationError as exc:
            return Response(exc.message_dict, status=status.HTTP_409_CONFLICT)
        return Response(TaskOutput(task).data)


class TaskEventsApi(APIView):
    @extend_schema(
        responses=EventOutput(many=True), summary="Events after a cursor (tool output truncated)",
        parameters=[OpenApiParameter("after", int, required=False), OpenApiParameter("limit", int, required=False)],
    )
    def get(self, request, pk: int):
        task = selectors.task_get(user=request.user, pk=pk)
        try:
            after = int(request.query_params.get("after", -1))
            limit = min(max(int(request.query_params.get("limit", 500)), 1), 2000)
        except ValueError:
            raise ValidationError({"detail": "after and limit must be integers"}) from None
        events = selectors.task_events_after(task=task, after=after, limit=limit)
        return Response([selectors.event_to_wire(event=e) for e in events])


class TaskEventOutputApi(APIView):
    @extend_schema(responses={200: {"type": "string"}}, summary="Full output of one tool result")
    def get(self, request, pk: int, seq: int):
        task = selectors.task_get(user=request.user, pk=pk)
        try:
            event = selectors.task_event_get(task=task, seq=seq)
        except TaskEvent.DoesNotExist:
            raise Http404 from None
        return HttpResponse(event.full_output, content_type="text/plain; charset=utf-8")


class TaskPatchApi(APIView):
    @extend_schema(responses={200: {"type": "string"}}, summary="The task's unified diff as a patch file")
    def get(self, request, pk: int):
        task = selectors.task_get(user=request.user, pk=pk)
        response = HttpResponse(task.diff, content_type="text/x-diff; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="flowstate-task-{task.pk}.patch"'
        return response
