from django.urls import path

from webapp.fleet import views

app_name = "fleet"
urlpatterns: list = [
    path("", views.fleet_dashboard, name="dashboard"),
    path("overview.json", views.fleet_overview_json, name="overview-json"),
]
