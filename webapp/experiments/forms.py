"""The launch form is generated from the typed AsyncRLConfig: one input per field, its docstring as help.

Django's number fields refuse what is not a finite number (NaN, Infinity, 1e309) or not an integer (1.5);
ranges are checked by the service (webapp.experiments.validation, after AsyncRLConfig's own rules, whose
messages explain them), and the form shows each error next to its field.
"""

from __future__ import annotations

from django import forms
from django.conf import settings

from webapp.core.validation import MAX_STRING_CHARS
from webapp.experiments.selectors import experiment_form_fields

_FIELD_TYPES = {
    "int": forms.IntegerField,
    "float": forms.FloatField,
    "bool": forms.BooleanField,
}


def _policy_model_choices(user) -> list[tuple[str, str]]:
    """The registered models the user may start a run from (never a typed path)."""
    from webapp.registry.selectors import registered_models_visible_to

    models = registered_models_visible_to(user=user).values_list("name", "family")
    return [("", "— none: start from init_checkpoint —"), *((name, f"{name} ({family})") for name, family in models)]


def _precision_choices(user) -> list[tuple[str, str]]:
    from training.rollout.config import EXPERT_PRECISIONS

    return [("", "— the checkpoint's own —"), *((name, name) for name in EXPERT_PRECISIONS)]


_CHOICE_FIELDS = {"policy_model": _policy_model_choices, "precision": _precision_choices}
"""Config fields chosen from a list, with the function giving a user's choices."""


class ExperimentForm(forms.Form):
    name = forms.CharField(max_length=200, help_text="Shown in lists and on every trace of the run.")
    share_with_team = forms.ModelChoiceField(
        queryset=None, required=False, empty_label="— private —",
        help_text="Teammates may view the experiment, its plots and rollouts; only you may pause, resume, cancel "
                  "or evaluate it.",
    )

    def __init__(self, *args, user, initial_config: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["share_with_team"].queryset = user.teams.all()
        initial_config = initial_config or {}
        for spec in experiment_form_fields():
            field_class = _FIELD_TYPES.get(spec["type"].replace(" | None", ""), forms.CharField)
            default = initial_config.get(spec["name"], spec["default"])
            if spec["name"] == "init_checkpoint" and not default:
                default = settings.MODEL_CHECKPOINT or ""
            options = {"help_text": spec["help"], "initial": default, "label": spec["name"]}
            # A field left empty takes the config's default, so only fields without one are required.
            if (
                spec["name"] == "init_checkpoint"  # empty: the configured default, or the chosen policy_model's
                or field_class is forms.BooleanField
                or spec["default"] is not None
                or spec["type"].endswith("| None")
            ):
                options["required"] = False
            if spec["name"] in _CHOICE_FIELDS:
                options.update(required=False, choices=_CHOICE_FIELDS[spec["name"]](user))
                self.fields[spec["name"]] = forms.ChoiceField(**options)
                continue
            if field_class is forms.CharField:
                options["max_length"] = MAX_STRING_CHARS
            self.fields[spec["name"]] = field_class(**options)

    def sections(self) -> list[dict]:
        """The config fields in sections (webapp.experiments.form_groups): title, shown fields, advanced ones."""
        from training.rollout.config import AsyncRLConfig
        from webapp.experiments.form_groups import GROUPS, config_sections

        names = [name for name in self.fields if name not in ("name", "share_with_team")]
        placed = config_sections(AsyncRLConfig, names)
        sections = []
        for key, title in GROUPS:
            members = [self[name] for name in names if placed[name][0] == key]
            if members:
                sections.append({"key": key, "title": title,
                                 "fields": [field for field in members if not placed[field.name][1]],
                                 "advanced": [field for field in members if placed[field.name][1]]})
        return sections

    def presets(self) -> dict[str, str]:
        """{label: JSON of the field values it sets} for the preset buttons."""
        import json

        from webapp.experiments.form_groups import presets_for

        return {label: json.dumps(values) for label, values in presets_for(list(self.fields)).items()}

    def config(self) -> dict:
        """The cleaned config fields (without the name and the sharing), for experiment_create."""
        values = {key: value for key, value in self.cleaned_data.items() if key not in ("name", "share_with_team")}
        return {key: value for key, value in values.items() if value is not None and value != ""}


class EvaluateForm(forms.Form):
    suite = forms.CharField(initial="toy-heldout-20", help_text="toy-heldout-N, toy-validation-N, toy-train-N, or a mined task set's taskset-ID-heldout / taskset-ID-train")
    attempts = forms.IntegerField(initial=1, min_value=1, max_value=16, help_text="k of pass@k")
