"""REST API root: each app contributes its routes through its own `api_urls` module."""

from django.urls import include, path

from webapp.accounts import api as accounts_api

urlpatterns = [
    path("me/", accounts_api.MeView.as_view(), name="api-me"),
    path("", include("webapp.agents.api_urls")),
    path("", include("webapp.fleet.api_urls")),
    path("", include("webapp.experiments.api_urls")),
]
