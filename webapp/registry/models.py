"""Registered models: open-weights Hugging Face checkpoints imported into Flowstate."""

from django.conf import settings
from django.db import models


class RegisteredModel(models.Model):
    """One imported model: its files live in `directory` (under settings.MODELS_ROOT).

    Without an owner the model was registered by the operator (manage.py import_model) and every signed-in
    user may use it; with one, only the owner and the members of `team` see it.
    """

    name = models.SlugField(max_length=100, unique=True, help_text="The `model` name clients ask for.")
    family = models.CharField(max_length=40, help_text="Hugging Face model_type (qwen3_moe, llama, ...).")
    total_parameters = models.BigIntegerField()
    active_parameters = models.BigIntegerField(help_text="Parameters used per token (differs for MoE).")
    dtype = models.CharField(max_length=20)
    source = models.CharField(max_length=1000, help_text="Directory or GGUF file the model was imported from.")
    source_format = models.CharField(
        max_length=20, default="hf", help_text="hf (a Hugging Face directory) or gguf (dequantised at import)."
    )
    source_checksum = models.CharField(
        max_length=64, blank=True, help_text="SHA-256 of the GGUF file an import was converted from."
    )
    checksum = models.CharField(max_length=64, help_text="SHA-256 over config.json and the weight files.")
    directory = models.CharField(max_length=1000, help_text="Where the imported files are kept.")
    size_bytes = models.BigIntegerField(default=0)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    team = models.ForeignKey(
        "accounts.Team", on_delete=models.SET_NULL, null=True, blank=True, related_name="+",
        help_text="Members of this team may use (not change) the model.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name
