from django.urls import path

from webapp.mining import api

urlpatterns = [
    path("task-sets/", api.TaskSetListApi.as_view(), name="api-task-sets"),
    path("task-sets/<int:pk>/", api.TaskSetDetailApi.as_view(), name="api-task-set"),
    path("task-sets/<int:pk>/cancel/", api.TaskSetCancelApi.as_view(), name="api-task-set-cancel"),
    path("task-sets/<int:pk>/export/", api.TaskSetExportApi.as_view(), name="api-task-set-export"),
    path("repositories/<int:pk>/environment/", api.RepositoryEnvironmentApi.as_view(), name="api-repository-environment"),
]
