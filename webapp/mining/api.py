"""REST API of repository environments and task sets: parse, call one service or selector, serialize.

A task set shared with a `team` is visible to its members; only its owner cancels it. Only a
repository's owner sets its environment up or mines it.
"""

from __future__ import annotations

from django.http import StreamingHttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.agents import selectors as agent_selectors
from webapp.agents.api import TeamNameField
from webapp.agents.models import Repository
from webapp.core.api import InputSerializer
from webapp.core.selectors import owned_get_for_change
from webapp.mining import presenters, selectors, services
from webapp.mining.models import MinedTask, TaskSet


class TaskSetOutput(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    team = serializers.CharField(source="team.name", default=None)
    repository_id = serializers.IntegerField(allow_null=True)

    class Meta:
        model = TaskSet
        fields = ("id", "name", "owner", "team", "repository_id", "repo_label", "repo_location", "commit", "recipe",
                  "settings", "status", "status_reason", "progress", "stats", "created_at", "started_at", "finished_at")


class MinedTaskOutput(serializers.ModelSerializer):
    class Meta:
        model = MinedTask
        fields = ("id", "task_id", "split", "source", "path", "kind", "fail_to_pass", "prompt", "diff", "expert_solved")


class TaskSetListApi(APIView):
    class TaskSetMineInput(InputSerializer):
        repository_id = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
        name = serializers.CharField(max_length=200)
        settings = serializers.DictField(required=False, help_text="MiningConfig fields (max_candidates, max_tasks, "
                                         "history_commits, seed, heldout_percent, time_budget_s, ...).")
        team = TeamNameField()

    @extend_schema(summary="Task sets visible to you", responses={200: TaskSetOutput(many=True)})
    def get(self, request):
        return Response(TaskSetOutput(selectors.task_set_list(user=request.user)[:200], many=True).data)

    @extend_schema(summary="Mine a task set from a repository you own", request=TaskSetMineInput, responses={201: TaskSetOutput})
    def post(self, request):
        data = self.TaskSetMineInput(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        values = data.validated_data
        repository = owned_get_for_change(queryset=Repository.objects.all(), user=request.user,
                                          pk=values["repository_id"])
        task_set = services.task_set_create(owner=request.user, repository=repository, name=values["name"],
                                            settings_values=values.get("settings"), team=values.get("team"))
        return Response(TaskSetOutput(task_set).data, status=status.HTTP_201_CREATED)


class TaskSetDetailApi(APIView):
    @extend_schema(summary="One task set with its tasks", responses={200: dict})
    def get(self, request, pk: int):
        task_set = selectors.task_set_get(user=request.user, pk=pk)
        return Response({**TaskSetOutput(task_set).data,
                         "tasks": MinedTaskOutput(task_set.tasks.all(), many=True).data,
                         "solve_rates": selectors.task_set_solve_rates(user=request.user, task_set=task_set)})


class TaskSetCancelApi(APIView):
    @extend_schema(summary="Cancel a queued or running mining job (owner only)", request=None,
                   responses={200: TaskSetOutput})
    def post(self, request, pk: int):
        task_set = services.task_set_cancel(task_set=selectors.task_set_get_for_change(user=request.user, pk=pk))
        return Response(TaskSetOutput(task_set).data)


class TaskSetExportApi(APIView):
    @extend_schema(summary="The set's tasks as JSON lines (?split=train|heldout)", responses={200: str})
    def get(self, request, pk: int):
        task_set = selectors.task_set_get(user=request.user, pk=pk)
        split = request.query_params.get("split")
        if split not in (None, "train", "heldout"):
            raise serializers.ValidationError({"split": ["use train or heldout"]})
        return StreamingHttpResponse(selectors.task_set_export_lines(task_set=task_set, split=split),
                                     content_type="application/x-ndjson")


class RepositoryEnvironmentApi(APIView):
    class RepositoryEnvironmentInput(InputSerializer):
        setup_commands = serializers.ListField(child=serializers.CharField(max_length=1000), required=False,
                                               max_length=20)
        test_command = serializers.CharField(max_length=1000, required=False)
        runner = serializers.ChoiceField(choices=("pytest", "unittest"), required=False)

    @extend_schema(summary="A repository's environment: recipe, baseline, failure and log", responses={200: dict})
    def get(self, request, pk: int):
        repository = agent_selectors.repository_get(user=request.user, pk=pk)
        recipe = selectors.repository_recipe(repository=repository)
        # "state": the same words the environment page shows (current step, elapsed time, failure, next step).
        if recipe is None:
            return Response({"status": "not set up", "state": presenters.environment_state(None)})
        return Response({"status": recipe.status, "recipe": recipe.recipe, "failure": recipe.failure,
                         "edited": recipe.edited, "budget": recipe.budget, "log": recipe.log,
                         "state": presenters.environment_state(recipe)})

    @extend_schema(summary="Set the environment up (owner only): detect, or the recipe given", request=RepositoryEnvironmentInput,
                   responses={202: dict})
    def post(self, request, pk: int):
        repository = owned_get_for_change(queryset=Repository.objects.all(), user=request.user, pk=pk)
        data = self.RepositoryEnvironmentInput(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        values = data.validated_data
        edited = None
        if values:
            edited = services.recipe_edited_parse(setup_commands="\n".join(values.get("setup_commands") or ()),
                                                  test_command=values.get("test_command", ""),
                                                  runner=values.get("runner", "pytest"))
        recipe = services.repository_setup_request(repository=repository, edited_recipe=edited)
        return Response({"status": recipe.status, "edited": recipe.edited}, status=status.HTTP_202_ACCEPTED)
