"""ASGI entry point: HTTP through Django, websockets through Channels with session or token auth."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

if settings.DEBUG or settings.SERVE_STATIC:
    # The embedded default has no reverse proxy in front; production serves STATIC_ROOT from one.
    django_asgi_app = ASGIStaticFilesHandler(django_asgi_app)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import re_path  # noqa: E402

from webapp.accounts.ws_auth import NotFoundConsumer, SessionOrTokenAuthMiddleware  # noqa: E402
from webapp.core.body_limit import RequestBodyLimit  # noqa: E402
from webapp.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Bodies over MAX_REQUEST_BYTES (archive uploads: MAX_UPLOAD_REQUEST_BYTES) get 413 before Django
        # spools them, signed in or not: see webapp.core.body_limit.
        "http": RequestBodyLimit(django_asgi_app),
        # Origin check for cookie sessions only, refusals as close codes: see webapp.accounts.ws_auth.
        # Unknown paths end at NotFoundConsumer (4404) rather than an exception.
        "websocket": SessionOrTokenAuthMiddleware(
            URLRouter([*websocket_urlpatterns, re_path(r"", NotFoundConsumer.as_asgi())])
        ),
    }
)
