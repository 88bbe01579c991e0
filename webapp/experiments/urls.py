from django.urls import path

from webapp.experiments import views

app_name = "experiments"
urlpatterns = [
    path("", views.experiment_list_view, name="experiment-list"),
    path("compare/", views.experiment_compare_view, name="experiment-compare"),
    path("benchmarks/", views.benchmark_leaderboard_view, name="benchmarks"),
    path("benchmarks/run/", views.benchmark_run_view, name="benchmark-run"),
    path("<int:pk>/", views.experiment_detail_view, name="experiment-detail"),
    path("<int:pk>/clone/", views.experiment_clone_view, name="experiment-clone"),
    path("<int:pk>/pause/", views.experiment_pause_view, name="experiment-pause"),
    path("<int:pk>/resume/", views.experiment_resume_view, name="experiment-resume"),
    path("<int:pk>/cancel/", views.experiment_cancel_view, name="experiment-cancel"),
    path("<int:pk>/groups/<str:group_id>/", views.experiment_group_view, name="experiment-group"),
    path(
        "<int:pk>/checkpoints/<int:checkpoint_pk>/evaluate/",
        views.checkpoint_evaluate_view,
        name="checkpoint-evaluate",
    ),
]
