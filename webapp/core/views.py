from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from webapp.core.health import health_report
from webapp.core.selectors_dashboard import dashboard_summary


@login_required
def dashboard(request):
    return render(request, "core/dashboard.html", {"summary": dashboard_summary(user=request.user)})


@never_cache
def healthz(request):
    report = health_report()
    # Only the database is fatal for serving pages; the rest degrade features, shown in the body.
    status = 200 if report["checks"]["database"]["ok"] else 503
    return JsonResponse(report, status=status)
