from django.urls import path

from webapp.agents import api

urlpatterns = [
    path("repositories/", api.RepositoryListApi.as_view(), name="api-repositories"),
    path("tasks/", api.TaskListApi.as_view(), name="api-tasks"),
    path("tasks/<int:pk>/", api.TaskDetailApi.as_view(), name="api-task"),
    path("tasks/<int:pk>/cancel/", api.TaskCancelApi.as_view(), name="api-task-cancel"),
    path("tasks/<int:pk>/events/", api.TaskEventsApi.as_view(), name="api-task-events"),
    path("tasks/<int:pk>/events/<int:seq>/output/", api.TaskEventOutputApi.as_view(), name="api-task-event-output"),
    path("tasks/<int:pk>/patch/", api.TaskPatchApi.as_view(), name="api-task-patch"),
]
