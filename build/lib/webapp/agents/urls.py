from django.urls import path

from webapp.agents import views

app_name = "agents"
urlpatterns = [
    path("", views.task_list, name="task-list"),
    path("repositories/", views.repository_list, name="repository-list"),
    path("<int:pk>/", views.task_detail, name="task-detail"),
    path("<int:pk>/cancel/", views.task_cancel, name="task-cancel"),
    path("<int:pk>/patch/", views.task_patch, name="task-patch"),
    path("traces/", views.trace_list, name="trace-list"),
    path("traces/compare/", views.trace_compare, name="trace-compare"),
]
