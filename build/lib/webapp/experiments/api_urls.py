from django.urls import path

from webapp.experiments import api

urlpatterns = [
    path("experiments/", api.ExperimentListApi.as_view(), name="api-experiments"),
    path("experiments/<int:pk>/", api.ExperimentDetailApi.as_view(), name="api-experiment"),
    path(
        "experiments/<int:pk>/<str:action>/", api.ExperimentActionApi.as_view(), name="api-experiment-action"
    ),
    path("benchmarks/", api.BenchmarkLeaderboardApi.as_view(), name="api-benchmarks"),
]
