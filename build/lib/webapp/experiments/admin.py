from django.contrib import admin

from webapp.experiments.models import (
    BenchmarkRun,
    BenchmarkTaskResult,
    Experiment,
    ExperimentCheckpoint,
    ExperimentRollout,
    ExperimentStep,
    RepositoryRecipe,
)


@admin.register(Experiment)
class ExperimentAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "status", "current_step", "launches", "heartbeat_at", "created_at")
    list_filter = ("status",)
    search_fields = ("name",)
    readonly_fields = ("run_dir", "driver_pid", "launches", "heartbeat_at", "started_at", "finished_at")


@admin.register(ExperimentStep)
class ExperimentStepAdmin(admin.ModelAdmin):
    list_display = ("experiment", "step", "recorded_at")
    raw_id_fields = ("experiment",)


@admin.register(ExperimentRollout)
class ExperimentRolloutAdmin(admin.ModelAdmin):
    list_display = ("experiment", "step", "rollout_id", "task_id", "valid", "reward", "passed", "staleness")
    list_filter = ("valid", "passed")
    search_fields = ("rollout_id", "task_id", "group_id")
    raw_id_fields = ("experiment", "trace")


@admin.register(ExperimentCheckpoint)
class ExperimentCheckpointAdmin(admin.ModelAdmin):
    list_display = ("experiment", "step", "path", "recorded_at")
    raw_id_fields = ("experiment",)


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = ("id", "suite", "policy_kind", "policy_label", "attempts", "status", "owner", "created_at")
    list_filter = ("status", "policy_kind", "suite")
    raw_id_fields = ("checkpoint",)


@admin.register(BenchmarkTaskResult)
class BenchmarkTaskResultAdmin(admin.ModelAdmin):
    list_display = ("run", "task_id", "attempts", "passes", "infrastructure_failures", "wall_s")
    raw_id_fields = ("run",)


@admin.register(RepositoryRecipe)
class RepositoryRecipeAdmin(admin.ModelAdmin):
    list_display = ("repository", "status", "updated_at")
    list_filter = ("status",)
