"""Read side of the model registry: which models a user may see and use."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db.models import Q, QuerySet
from django.http import Http404

from webapp.registry.models import RegisteredModel


def registered_models_visible_to(*, user: AbstractBaseUser | AnonymousUser) -> QuerySet[RegisteredModel]:
    """Operator-registered models (no owner), the user's own, and those shared with one of their teams."""
    if not user.is_authenticated:
        return RegisteredModel.objects.none()
    return (
        RegisteredModel.objects.filter(Q(owner__isnull=True) | Q(owner=user) | Q(team__members=user))
        .distinct()
        .order_by("name")
    )


def registered_model_for(*, user: AbstractBaseUser | AnonymousUser, name: str) -> RegisteredModel:
    """The visible model called `name`, or 404 (outsiders cannot tell a hidden model from a missing one)."""
    try:
        return registered_models_visible_to(user=user).get(name=name)
    except RegisteredModel.DoesNotExist:
        raise Http404 from None
