from django.urls import path

from webapp.agents import api, api_conversation

urlpatterns = [
    path("repositories/", api.RepositoryListApi.as_view(), name="api-repositories"),
    path("tasks/", api.TaskListApi.as_view(), name="api-tasks"),
    path("tasks/<int:pk>/", api.TaskDetailApi.as_view(), name="api-task"),
    path("tasks/<int:pk>/cancel/", api.TaskCancelApi.as_view(), name="api-task-cancel"),
    path("tasks/<int:pk>/events/", api.TaskEventsApi.as_view(), name="api-task-events"),
    path("tasks/<int:pk>/events/<int:seq>/output/", api.TaskEventOutputApi.as_view(), name="api-task-event-output"),
    path("tasks/<int:pk>/patch/", api.TaskPatchApi.as_view(), name="api-task-patch"),
    path("tasks/<int:pk>/followups/", api_conversation.TaskFollowUpsApi.as_view(), name="api-task-followups"),
    path("tasks/<int:pk>/branch/", api_conversation.TaskBranchApi.as_view(), name="api-task-branch"),
    path("tasks/<int:pk>/bundle/", api_conversation.TaskBundleApi.as_view(), name="api-task-bundle"),
    path("repositories/<int:pk>/credentials/", api_conversation.RepositoryCredentialsApi.as_view(),
         name="api-repository-credentials"),
]
