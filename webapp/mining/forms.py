"""Forms of the mining app: the editable recipe and a mining request."""

from __future__ import annotations

from django import forms


class RecipeForm(forms.Form):
    setup_commands = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4}), required=False, max_length=20_000,
        help_text="One command per line, run once when the snapshot is built (network on when REPO_SETUP_NETWORK).")
    # Not required by the browser: "Detect and set up" posts this form to fill the recipe itself; saving a
    # recipe of one's own checks for a test command on the server (repository_setup).
    test_command = forms.CharField(max_length=1000, required=False,
                                   help_text="Runs the whole suite verbosely from the repository root.")
    runner = forms.ChoiceField(choices=(("pytest", "pytest (-rA output)"), ("unittest", "unittest (-v output)")))


class MineForm(forms.Form):
    name = forms.CharField(max_length=200)
    max_candidates = forms.IntegerField(initial=200, min_value=1, help_text="Candidate bugs validated in all.")
    max_tasks = forms.IntegerField(initial=100, min_value=1, help_text="Stop once this many tasks validated.")
    history_commits = forms.IntegerField(initial=100, min_value=0, max_value=10_000,
                                         help_text="Newest commits examined for code+test changes.")
    heldout_percent = forms.IntegerField(initial=25, min_value=0, max_value=90, help_text="Files held out.")
    seed = forms.IntegerField(initial=0, min_value=0, max_value=2**31 - 1)
    time_budget_s = forms.FloatField(initial=1800.0, min_value=1.0, max_value=86_400.0)
    selection = forms.ChoiceField(initial="calls", required=False, choices=(
        ("calls", "only the tests that call the mutated function"),
        ("calls+full", "those, then the whole suite for a candidate that fails there"),
        ("full", "the whole suite for every candidate"),
    ), help_text="Tests each candidate runs (pytest recipes; unittest ones always run the whole suite).")
    share_with_team = forms.ModelChoiceField(queryset=None, required=False, empty_label="— private —")

    def __init__(self, *args, user, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["share_with_team"].queryset = user.teams.all()

    def settings_values(self) -> dict:
        return {key: value for key, value in self.cleaned_data.items()
                if key not in ("name", "share_with_team") and value not in (None, "")}
