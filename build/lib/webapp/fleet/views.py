from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import render

from webapp.fleet.selectors import fleet_overview, fleet_utilisation_series


@login_required
def fleet_dashboard(request):
    return render(
        request,
        "fleet/dashboard.html",
        {"overview": fleet_overview(), "series": fleet_utilisation_series(window_s=600)},
    )


@login_required
def fleet_overview_json(request):
    return JsonResponse({"overview": fleet_overview(), "series": fleet_utilisation_series(window_s=600)})
