from django.urls import path

from webapp.agents import views, views_conversation

app_name = "agents"
urlpatterns = [
    path("", views.task_list, name="task-list"),
    path("repositories/", views.repository_list, name="repository-list"),
    path("<int:pk>/", views.task_detail, name="task-detail"),
    path("<int:pk>/cancel/", views.task_cancel, name="task-cancel"),
    path("<int:pk>/patch/", views.task_patch, name="task-patch"),
    path("<int:pk>/index-progress/", views.task_index_progress, name="task-index-progress"),
    path("<int:pk>/followup/", views_conversation.task_followup, name="task-followup"),
    path("<int:pk>/branch/", views_conversation.task_branch, name="task-branch"),
    path("<int:pk>/bundle/", views_conversation.task_bundle, name="task-bundle"),
    path("traces/", views.trace_list, name="trace-list"),
    path("traces/compare/", views.trace_compare, name="trace-compare"),
]
