from django.urls import path

from webapp.mining import views

app_name = "mining"
urlpatterns = [
    path("", views.mining_home, name="home"),
    path("repositories/<int:pk>/", views.repository_environment, name="repository"),
    path("repositories/<int:pk>/setup/", views.repository_setup, name="repository-setup"),
    path("sets/<int:pk>/", views.task_set_detail, name="task-set-detail"),
    path("sets/<int:pk>/progress/", views.task_set_progress, name="task-set-progress"),
    path("sets/<int:pk>/cancel/", views.task_set_cancel, name="task-set-cancel"),
    path("sets/<int:pk>/export.jsonl", views.task_set_export, name="task-set-export"),
    path("sets/<int:pk>/tasks/<int:task_pk>/", views.mined_task_detail, name="mined-task"),
]
