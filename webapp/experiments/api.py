"""REST API of experiments and benchmarks: parse, call one service or selector, serialize.

Services' ValidationErrors become 400/409 responses in webapp.core.api.exception_handler. An
experiment shared with a `team` is visible to its members; only its owner may act on it.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.agents.api import TeamNameField
from webapp.core.api import InputSerializer, TypedConfigField
from webapp.core.validation import text_check
from webapp.experiments import services
from webapp.experiments.models import BenchmarkRun, Experiment
from webapp.experiments.selectors import (
    benchmark_leaderboard,
    experiment_get,
    experiment_get_for_change,
    experiment_list,
    experiment_steps,
)
from webapp.experiments.validation import experiment_config_check


class ExperimentOutput(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    team = serializers.CharField(source="team.name", default=None)

    class Meta:
        model = Experiment
        fields = (
            "id",
            "name",
            "owner",
            "team",
            "status",
            "status_reason",
            "config",
            "current_step",
            "parent",
            "launches",
            "created_at",
            "started_at",
            "finished_at",
        )


class ExperimentConfigField(TypedConfigField):
    """The launch config, checked for the requesting user: the registered checkpoints and models they may use."""

    def __init__(self, **kwargs) -> None:
        super().__init__(check=self._check_for_user, **kwargs)

    def _check_for_user(self, data: dict) -> dict:
        request = self.context.get("request")
        return experiment_config_check(data, owner=getattr(request, "user", None))


class ExperimentListApi(APIView):
    class Input(InputSerializer):
        name = serializers.CharField(max_length=200)
        config = ExperimentConfigField(help_text="AsyncRLConfig fields; each has a type and a range.")
        team = TeamNameField()

    @extend_schema(summary="Experiments visible to you", responses={200: ExperimentOutput(many=True)})
    def get(self, request):
        return Response(ExperimentOutput(experiment_list(user=request.user)[:200], many=True).data)

    @extend_schema(
        summary="Launch an experiment from an AsyncRLConfig", request=Input, responses={201: ExperimentOutput}
    )
    def post(self, request):
        data = self.Input(data=request.data, context={"request": request})
        data.is_valid(raise_exception=True)
        experiment = services.experiment_create(owner=request.user, **data.validated_data)
        return Response(ExperimentOutput(experiment).data, status=status.HTTP_201_CREATED)


class ExperimentDetailApi(APIView):
    @extend_schema(summary="One experiment with its per-step metrics", responses={200: dict})
    def get(self, request, pk: int):
        experiment = experiment_get(user=request.user, pk=pk)
        return Response(
            {**ExperimentOutput(experiment).data, "steps": experiment_steps(experiment=experiment)}
        )


class ExperimentActionApi(APIView):
    ACTIONS = (
        ("pause", services.experiment_pause),
        ("resume", services.experiment_resume),
        ("cancel", services.experiment_cancel),
    )

    @extend_schema(
        summary="Pause, resume or cancel an experiment", operation_id="experiments_action", request=None, responses={200: ExperimentOutput}
    )
    def post(self, request, pk: int, action: str):
        actions = dict(self.ACTIONS)
        if action not in actions:
            raise ValidationError({"action": f"unknown action; use one of {sorted(actions)}"})
        experiment = experiment_get_for_change(user=request.user, pk=pk)
        experiment = actions[action](experiment=experiment)  # a state conflict: 409 (exception handler)
        return Response(ExperimentOutput(experiment).data)


class BenchmarkRunOutput(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkRun
        fields = (
            "id",
            "suite",
            "policy_kind",
            "policy_label",
            "attempts",
            "status",
            "summary",
            "created_at",
            "finished_at",
        )


class BenchmarkLeaderboardApi(APIView):
    @extend_schema(
        summary="Finished benchmark runs, best pass@1 first", responses={200: BenchmarkRunOutput(many=True)}
    )
    def get(self, request):
        try:
            suite = text_check("suite", request.query_params.get("suite") or "", max_chars=100) or None
        except ValueError as exc:
            raise ValidationError({"suite": [str(exc)]}) from None
        runs = benchmark_leaderboard(user=request.user, suite=suite)
        return Response(BenchmarkRunOutput(runs, many=True).data)
