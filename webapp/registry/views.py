"""The Models page: registered models the signed-in user may use."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from webapp.registry.selectors import registered_models_visible_to


@login_required
def model_list_view(request):
    return render(request, "registry/model_list.html", {"models": registered_models_visible_to(user=request.user)})
