import hmac

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache
from prometheus_client import CONTENT_TYPE_LATEST

from webapp.core.health import health_report, public_report
from webapp.core.metrics import metrics_text
from webapp.core.selectors_dashboard import dashboard_summary


@login_required
def dashboard(request):
    return render(request, "core/dashboard.html", {"summary": dashboard_summary(user=request.user)})


@never_cache
def healthz(request):
    """Each dependency's state; its details (addresses, socket paths, worker names, errors) only for those
    who may read /metrics (staff or the METRICS_TOKEN bearer), everyone else gets ok/down per component."""
    report = health_report()
    # Only the database is fatal for serving pages; the rest degrade features, shown in the body.
    status = 200 if report["checks"]["database"]["ok"] else 503
    return JsonResponse(report if _metrics_allowed(request) else public_report(report), status=status)


def _metrics_allowed(request) -> bool:
    token = settings.METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    return request.user.is_authenticated and request.user.is_staff


@never_cache
def metrics(request):
    """Prometheus text format; for staff sessions or ``Authorization: Bearer <METRICS_TOKEN>``."""
    if not _metrics_allowed(request):
        status = 403 if request.user.is_authenticated else 401
        response = HttpResponse("metrics need a staff account or the METRICS_TOKEN bearer token\n",
                                status=status, content_type="text/plain")
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(metrics_text(), content_type=CONTENT_TYPE_LATEST)

