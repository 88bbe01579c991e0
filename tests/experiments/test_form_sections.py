"""The launch form in sections generated from the typed config: every field once, metadata first."""

from __future__ import annotations

import dataclasses
import json

import pytest
from django.test import Client

from webapp.experiments.form_groups import config_sections, field_group
from webapp.experiments.forms import ExperimentForm


@dataclasses.dataclass
class _Reshaped:
    lr: float = 1e-5
    """An optimiser field by its name."""
    batch_rollouts: int = dataclasses.field(default=8, metadata={"group": "run", "advanced": True})
    """Metadata wins over the name."""
    brand_new_knob: int = 1
    """Unknown to every rule: shown, in Other."""



def test_sections_come_from_metadata_then_names_and_never_hide_new_fields():
    fields = {item.name: item for item in dataclasses.fields(_Reshaped)}
    assert field_group(fields["lr"]) == ("optimiser", False)
    assert field_group(fields["batch_rollouts"]) == ("run", True)
    assert field_group(fields["brand_new_knob"]) == ("other", False)
    assert config_sections(_Reshaped, ["lr", "missing"])["missing"] == ("other", False)


@pytest.mark.django_db
def test_the_launch_form_shows_every_config_field_once_in_sections_with_presets(owner):
    form = ExperimentForm(user=owner)
    sections = form.sections()
    placed = [field.name for section in sections for field in section["fields"] + section["advanced"]]
    config_names = [name for name in form.fields if name not in ("name", "share_with_team")]
    assert sorted(placed) == sorted(config_names)
    assert [s["key"] for s in sections][:5] == ["run", "rollouts", "optimiser", "reward", "infrastructure"]
    run = next(s for s in sections if s["key"] == "run")
    assert "steps" in [f.name for f in run["fields"]]  # essential fields stay visible
    assert any(s["advanced"] for s in sections)
    presets = {label: json.loads(values) for label, values in form.presets().items()}
    assert all(set(values) <= set(form.fields) for values in presets.values())

    client = Client()
    client.force_login(owner)
    page = client.get("/experiments/").content.decode()
    assert page.count('<fieldset class="config-section"') == len(sections) and "Advanced (" in page
    assert "data-preset=" in page and 'name="steps"' in page
