from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from webapp.accounts.limits import limits_of
from webapp.accounts.services import api_token_get_or_create, api_token_rotate


@login_required
@require_http_methods(["GET", "POST"])
def account(request):
    if request.method == "POST":
        token = api_token_rotate(user=request.user)
    else:
        token = api_token_get_or_create(user=request.user)
    return render(request, "accounts/account.html", {"token": token, "limits": limits_of(request.user)})
