"""Read-side access rules shared by every app."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db.models import Model, Q, QuerySet
from django.http import Http404


def owned_visible_to(*, queryset: QuerySet, user: AbstractBaseUser | AnonymousUser) -> QuerySet:
    """Objects the user may view: their own and those shared with one of their teams."""
    if not user.is_authenticated:
        return queryset.none()
    return queryset.filter(Q(owner=user) | Q(team__members=user)).distinct()


def owned_get_visible(*, queryset: QuerySet, user: AbstractBaseUser | AnonymousUser, pk) -> Model:
    """One visible object, or 404 (never 403, so outsiders cannot probe which ids exist)."""
    try:
        return owned_visible_to(queryset=queryset, user=user).get(pk=pk)
    except queryset.model.DoesNotExist:
        raise Http404 from None


def owned_get_for_change(*, queryset: QuerySet, user: AbstractBaseUser | AnonymousUser, pk) -> Model:
    """An object the user may change: only its owner. Teammates get 404 on change actions too."""
    if not user.is_authenticated:
        raise Http404
    try:
        return queryset.get(pk=pk, owner=user)
    except queryset.model.DoesNotExist:
        raise Http404 from None
