"""REST API of the agents app: parse input, call one service or selector, format the output.

Field names are the same both ways: ``repository_id`` is a registered repository's id in a submission
and in a task (``repository_label`` is what the task shows: a repository's name, a git URL's last
part or an archive's file name); ``team`` is the name of the team an object is shared with. Unknown
input fields are refused by name; ``share_with_team`` is still accepted as the old name of ``team``.
Services' ValidationErrors become 400/409 responses in webapp.core.api.exception_handler.
"""

from __future__ import annotations

from django.http import Http404, HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.agents import selectors, services
from webapp.agents.models import AgentTask, Repository, TaskEvent
from webapp.agents.validation import agent_limits_check, policy_options_check
from webapp.agents.views import builtin_base_url_for, task_filters_from
from webapp.core.api import BoundedLimitOffsetPagination, InputSerializer, TypedConfigField
from webapp.core.validation import Range, query_integer

EVENT_SEQ_RANGE = Range(-1, 2**31 - 1)
EVENT_PAGE_RANGE = Range(1, 2000)


class TeamNameField(serializers.CharField):
    """The name of one of the requesting user's teams, as the Team (blank: not shared)."""

    def __init__(self, **kwargs):
        super().__init__(required=False, allow_blank=True, max_length=150,
                         help_text="Name of one of your teams to share with (teammates may view, not change).",
                         **kwargs)

    def run_validation(self, data=serializers.empty):
        name = (super().run_validation(data) or "").strip()  # the string, checked (length, NUL characters)
        if not name:
            return None  # not shared
        team = self.context["request"].user.teams.filter(name=name).first()
        if team is None:
            raise serializers.ValidationError(f"you are not a member of a team named '{name}'")
        return team


class RepositoryOutput(serializers.ModelSerializer):
    team = serializers.CharField(source="team.name", default=None)

    class Meta:
        model = Repository
        fields = ("id", "name", "kind", "location", "ref", "description", "team", "created_at")


class RepositoryInput(InputSerializer):
    name = serializers.CharField(max_length=120)
    kind = serializers.ChoiceField(choices=["git", "archive"])
    location = serializers.CharField(required=False, allow_blank=True, max_length=1000, help_text="Git URL (kind=git).")
    ref = serializers.CharField(required=False, allow_blank=True, max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, max_length=20000)
    archive = serializers.FileField(required=False, help_text=".tar.gz, .tgz, .tar or .zip (kind=archive).")
    team = TeamNameField()


class TaskOutput(serializers.ModelSerializer):
    repository_label = serializers.CharField(source="repo_label")
    owner = serializers.CharField(source="owner.username")
    team = serializers.CharField(source="team.name", default=None)
    verdict = serializers.CharField(read_only=True, help_text="finished, tests pass / tests fail / no tests; failed (why)")
    events_url = serializers.SerializerMethodField()
    patch_url = serializers.SerializerMethodField()
    websocket_path = serializers.SerializerMethodField()

    class Meta:
        model = AgentTask
        fields = (
            "id", "public_id", "source", "owner", "team", "repository_id", "repository_label", "repo_kind", "prompt",
            "backend", "model_name", "limits", "policy_options", "sandbox_runtime", "status", "status_reason", "outcome",
            "verdict",
            "test_command", "test_summary", "test_output", "attempt", "last_seq",
            "created_at", "started_at", "finished_at", "final_message", "turns", "prompt_tokens", "completion_tokens",
            "experiment_name", "training_step", "reward", "advantage", "events_url", "patch_url", "websocket_path",
        )

    def get_events_url(self, task) -> str:
        return f"/api/tasks/{task.pk}/events/"

    def get_patch_url(self, task) -> str:
        return f"/api/tasks/{task.pk}/patch/"

    def get_websocket_path(self, task) -> str:
        return f"/ws/tasks/{task.pk}/events/"


class TaskInput(InputSerializer):
    aliases = {"share_with_team": "team"}

    prompt = serializers.CharField(max_length=20000)
    backend = serializers.ChoiceField(choices=AgentTask.Backend.values)
    repository_id = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1,
                                             help_text="A registered repository you may see.")
    git_url = serializers.CharField(required=False, allow_blank=True, max_length=1000)
    git_ref = serializers.CharField(required=False, allow_blank=True, max_length=200)
    archive = serializers.FileField(required=False, help_text="Upload instead of a repository or git URL.")
    model_name = serializers.CharField(required=False, allow_blank=True, max_length=200, help_text="backend=openai: the remote model; backend=builtin: a registered model name (default: the configured checkpoint).")
    base_url = serializers.CharField(required=False, allow_blank=True, max_length=500,
                                     help_text="backend=openai only: an http(s) server on a public address "
                                               "(internal ones are refused unless the operator allow-lists the host).")
    api_key = serializers.CharField(required=False, allow_blank=True, write_only=True, max_length=500,
                                    help_text="backend=openai only; never returned.")
    limits = TypedConfigField(check=agent_limits_check, required=False,
                              help_text="AgentLimits fields, e.g. {\"max_turns\": 20}.")
    policy_options = TypedConfigField(check=dict, required=False,
                                      help_text="scripted: {\"step_delay_s\": 0.5}; others: {\"seed\": 1}.")
    team = TeamNameField()
    sandbox_runtime = serializers.CharField(
        required=False, allow_blank=True, max_length=64,
        help_text="Isolation tier: an OCI runtime of SANDBOX_RUNTIMES_ALLOWED (e.g. runsc, gVisor); blank: the default.")

    def unknown_field_message(self, name: str) -> str:
        if name == "repository":
            return "unknown field; give repository_id, the id of a registered repository (GET /api/repositories/)"
        return super().unknown_field_message(name)

    def validate(self, attrs):
        if "policy_options" in attrs:  # its allowed keys depend on the backend
            attrs["policy_options"] = policy_options_check(backend=attrs["backend"], options=attrs["policy_options"])
        return attrs


class EventOutput(serializers.Serializer):
    seq = serializers.IntegerField()
    kind = serializers.CharField()
    turn = serializers.IntegerField()
    ts = serializers.FloatField()
    attempt = serializers.IntegerField()
    payload = serializers.JSONField()
    has_full_output = serializers.BooleanField()


class RepositoryListApi(APIView):
    @extend_schema(responses=RepositoryOutput(many=True), summary="Repositories you may use")
    def get(self, request):
        return Response(RepositoryOutput(selectors.repository_list(user=request.user), many=True).data)

    @extend_schema(request=RepositoryInput, responses={201: RepositoryOutput}, summary="Register a repository")
    def post(self, request):
        data = RepositoryInput(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        repo = services.repository_create(owner=request.user, **data.validated_data)
        return Response(RepositoryOutput(repo).data, status=status.HTTP_201_CREATED)


class TaskListApi(APIView):
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
        paginator = BoundedLimitOffsetPagination()
        page = paginator.paginate_queryset(tasks, request, view=self)
        return paginator.get_paginated_response(TaskOutput(page, many=True).data)

    @extend_schema(request=TaskInput, responses={201: TaskOutput}, summary="Submit a coding task")
    def post(self, request):
        data = TaskInput(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        repository = None
        if "repository_id" in values:
            try:
                repository = selectors.repository_get(user=request.user, pk=values.pop("repository_id"))
            except Http404:
                raise ValidationError({"repository_id": ["no repository with this id is visible to you"]}) from None
        task = services.task_create(owner=request.user, repository=repository,
                                    builtin_base_url=builtin_base_url_for(request), **values)
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
        task = services.task_cancel(task=task, user=request.user)  # a finished task: 409 (exception handler)
        return Response(TaskOutput(task).data)


class TaskEventsApi(APIView):
    @extend_schema(
        responses=EventOutput(many=True), summary="Events after a cursor (tool output truncated)",
        parameters=[OpenApiParameter("after", int, required=False), OpenApiParameter("limit", int, required=False)],
    )
    def get(self, request, pk: int):
        task = selectors.task_get(user=request.user, pk=pk)
        try:
            after = query_integer(request.query_params, "after", default=-1, bounds=EVENT_SEQ_RANGE)
            limit = query_integer(request.query_params, "limit", default=500, bounds=EVENT_PAGE_RANGE)
        except ValueError as exc:
            raise ValidationError({str(exc).split(" ", 1)[0]: [str(exc)]}) from None
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
