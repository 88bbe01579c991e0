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
        if "task_set" in self.fields:
            self.fields["task_set"] = _task_set_field(user=user, base=self.fields["task_set"])

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


def _task_set_field(*, user, base: forms.Field) -> forms.TypedChoiceField:
    """The experiment's task source: a menu of the ready task sets (with train tasks) the user may see."""
    from webapp.mining.selectors import task_set_choices

    return forms.TypedChoiceField(
        choices=[("", "— none: the toy / standard-library tiers —"), *task_set_choices(user=user, split="train")],
        coerce=int, empty_value=None, required=False, initial=base.initial, label="task_set",
        help_text=base.help_text,
    )


class EvaluateForm(forms.Form):
    suite = forms.CharField(initial="toy-heldout-20", required=False,
                            help_text="toy-heldout-N, toy-validation-N or toy-train-N (N tasks)")
    task_set_suite = forms.ChoiceField(required=False, label="or a task set",
                                       help_text="A mined task set you may see (its held-out or train split); "
                                                 "chosen, it replaces the suite.")
    attempts = forms.IntegerField(initial=1, min_value=1, max_value=16, help_text="k of pass@k")

    def __init__(self, *args, user, **kwargs) -> None:
        from webapp.mining.selectors import task_set_suite_choices

        super().__init__(*args, **kwargs)
        self.fields["task_set_suite"].choices = [("", "—"), *task_set_suite_choices(user=user)]

    def clean(self) -> dict:
        cleaned = super().clean()
        if cleaned.get("task_set_suite"):
            cleaned["suite"] = cleaned["task_set_suite"]
        elif not cleaned.get("suite"):
            raise forms.ValidationError("choose a suite or a task set")
        return cleaned


class BenchmarkRunForm(forms.Form):
    """Benchmark a task set from the leaderboard: its suite and a policy, both from menus."""

    suite = forms.ChoiceField(label="Task set", help_text="A mined task set you may see: its held-out or train split.")
    policy = forms.ChoiceField(help_text="The scripted expert, or the served model (FLOWSTATE_MODEL_CHECKPOINT).")
    attempts = forms.IntegerField(initial=1, min_value=1, max_value=16, help_text="k of pass@k")

    def __init__(self, *args, user, **kwargs) -> None:
        from webapp.mining.selectors import task_set_suite_choices

        super().__init__(*args, **kwargs)
        self.fields["suite"].choices = task_set_suite_choices(user=user)
        policies = [("scripted", "scripted expert")]
        if settings.MODEL_CHECKPOINT:
            policies.append(("served", f"served model ({settings.MODEL_CHECKPOINT})"))
        self.fields["policy"].choices = policies

    def policy_spec(self) -> str:
        """The policy string benchmark_run_create takes."""
        policy = self.cleaned_data["policy"]
        return f"checkpoint:{settings.MODEL_CHECKPOINT}" if policy == "served" else policy
