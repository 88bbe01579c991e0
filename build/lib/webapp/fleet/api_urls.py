from django.urls import path

from webapp.fleet import api

urlpatterns = [
    path("fleet/", api.FleetOverviewApi.as_view(), name="api-fleet"),
]
