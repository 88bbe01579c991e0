"""The dashboard's read model: a few counts from every app, for the signed-in user only."""

from __future__ import annotations

from django.apps import apps

from webapp.core.selectors import owned_visible_to


def dashboard_summary(*, user) -> list[dict]:
    cards = []
    for label, model_name, url in (
        ("Tasks", "agents.AgentTask", "/tasks/"),
        ("Experiments", "experiments.Experiment", "/experiments/"),
    ):
        try:
            model = apps.get_model(model_name)
        except LookupError:
            continue
        cards.append({"label": label, "count": owned_visible_to(queryset=model.objects.all(), user=user).count(), "url": url})
    return cards
