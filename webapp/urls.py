from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from webapp.core import views as core_views

urlpatterns = [
    path("", core_views.dashboard, name="dashboard"),
    path("healthz", core_views.healthz, name="healthz"),
    path("metrics", core_views.metrics, name="metrics"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("account/", include("webapp.accounts.urls")),
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("tasks/", include("webapp.agents.urls")),
    path("fleet/", include("webapp.fleet.urls")),
    path("experiments/", include("webapp.experiments.urls")),
    path("mining/", include("webapp.mining.urls")),
    path("models/", include("webapp.registry.urls")),
    path("api/", include("webapp.core.api_urls")),
    path("v1/", include("webapp.agents.openai_urls")),
]
