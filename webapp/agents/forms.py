"""HTML form of task submission (parsing only; validation that needs the database is in services)."""

from __future__ import annotations

from django import forms
from django.conf import settings

from webapp.agents.models import AgentTask
from webapp.agents.selectors import repository_list
from webapp.agents.validation import STEP_DELAY_RANGE, agent_limit_bounds
from webapp.core.forms import bounded_number_field
from webapp.registry.selectors import registered_models_visible_to


class TaskSubmitForm(forms.Form):
    repository = forms.ModelChoiceField(queryset=None, required=False, empty_label="— none: use a git URL or archive —")
    git_url = forms.CharField(required=False, label="Git URL", help_text="https://… or git://…")
    git_ref = forms.CharField(required=False, label="Git ref")
    archive = forms.FileField(required=False, help_text=".tar.gz, .tgz, .tar or .zip")
    prompt = forms.CharField(widget=forms.Textarea(attrs={"rows": 5}), max_length=20000)
    backend = forms.ChoiceField(choices=AgentTask.Backend.choices, initial=AgentTask.Backend.SCRIPTED)
    registered_model = forms.ModelChoiceField(
        queryset=None, required=False, to_field_name="name", empty_label="— the configured checkpoint —",
        help_text="Built-in backend: an imported open-weights model (see Models)")
    model_name = forms.CharField(required=False, help_text="OpenAI-compatible backend only")
    base_url = forms.CharField(required=False, label="Base URL", help_text="OpenAI-compatible backend only, on a public address, e.g. https://api.openai.com/v1")
    api_key = forms.CharField(required=False, label="API key", widget=forms.PasswordInput(render_value=False))
    # Ranges: the same as the API's and the service's (webapp.agents.validation), set in __init__ from settings.
    max_turns = forms.IntegerField(initial=30)
    max_tokens = forms.IntegerField(initial=100_000, label="Max completion tokens")
    wall_time_s = forms.IntegerField(initial=1800, label="Wall time (s)")
    step_delay_s = forms.FloatField(min_value=STEP_DELAY_RANGE.minimum, max_value=STEP_DELAY_RANGE.maximum, initial=1.0,
                                    required=False, label="Scripted step delay (s)",
                                    help_text="Scripted expert only: pause per step so you can watch")
    share_with_team = forms.ModelChoiceField(queryset=None, required=False, empty_label="— private —")
    sandbox_runtime = forms.ChoiceField(required=False, label="Sandbox isolation",
                                        help_text="OCI runtime of the task's container: runsc is gVisor")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        # The tiers this server allows (SANDBOX_RUNTIMES_ALLOWED); the service checks the choice again.
        self.fields["sandbox_runtime"].choices = [("", f"default ({settings.SANDBOX_DOCKER_RUNTIME})")] + [
            (name, name) for name in settings.SANDBOX_RUNTIMES_ALLOWED if name != settings.SANDBOX_DOCKER_RUNTIME]
        bounds = agent_limit_bounds()
        for name, minimum in (("max_turns", 1), ("max_tokens", 16), ("wall_time_s", 10)):
            self.fields[name] = bounded_number_field(forms.IntegerField, bounds[name], min_value=minimum,
                                                     initial=self.fields[name].initial, label=self.fields[name].label)
        self.fields["repository"].queryset = repository_list(user=user)
        self.fields["registered_model"].queryset = registered_models_visible_to(user=user)
        self.fields["share_with_team"].queryset = user.teams.all()
        repositories = list(self.fields["repository"].queryset[:2])
        if len(repositories) == 1:
            self.fields["repository"].initial = repositories[0].pk

    GROUPS = (
        ("Task", ("prompt",), True),
        ("Code: one of a registered repository, a git URL or an archive", ("repository", "git_url", "git_ref", "archive"), False),
        ("Policy", ("backend", "registered_model", "model_name", "base_url", "api_key", "step_delay_s"), False),
        ("Limits and sharing", ("max_turns", "max_tokens", "wall_time_s", "sandbox_runtime", "share_with_team"), False),
    )

    def groups(self) -> list[dict]:
        return [{"title": title, "fields": [self[name] for name in names], "wide": wide} for title, names, wide in self.GROUPS]

    def service_arguments(self) -> dict:
        data = self.cleaned_data
        backend = data["backend"]
        policy_options = {}
        if backend == AgentTask.Backend.SCRIPTED and data.get("step_delay_s") is not None:
            policy_options["step_delay_s"] = data["step_delay_s"]
        return {
            "prompt": data["prompt"], "backend": backend, "repository": data.get("repository"),
            "git_url": data.get("git_url") or "", "git_ref": data.get("git_ref") or "", "archive": data.get("archive"),
            "model_name": (data["registered_model"].name if backend == AgentTask.Backend.BUILTIN
                           and data.get("registered_model") else data.get("model_name") or ""),
            "base_url": data.get("base_url") or "",
            "api_key": data.get("api_key") or "", "team": data.get("share_with_team"), "policy_options": policy_options,
            "sandbox_runtime": data.get("sandbox_runtime") or "",
            "limits": {"max_turns": data["max_turns"], "max_tokens": data["max_tokens"], "wall_time_s": float(data["wall_time_s"]),
                       "max_tokens_per_turn": min(1024, data["max_tokens"])},
        }


class RepositoryForm(forms.Form):
    name = forms.CharField(max_length=120)
    kind = forms.ChoiceField(choices=(("git", "Git URL"), ("archive", "Uploaded archive")))
    location = forms.CharField(required=False, label="Git URL")
    ref = forms.CharField(required=False, label="Git ref")
    archive = forms.FileField(required=False, help_text=".tar.gz, .tgz, .tar or .zip")
    share_with_team = forms.ModelChoiceField(queryset=None, required=False, empty_label="— private —")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["share_with_team"].queryset = user.teams.all()

    def service_arguments(self) -> dict:
        data = self.cleaned_data
        return {"name": data["name"], "kind": data["kind"], "location": data.get("location") or "",
                "ref": data.get("ref") or "", "archive": data.get("archive"), "team": data.get("share_with_team")}
