from django.urls import path

from webapp.registry import views

urlpatterns = [
    path("", views.model_list_view, name="model-list"),
]
