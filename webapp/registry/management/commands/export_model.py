"""manage.py export_model NAME OUT_DIR: write a registered model as a Hugging Face directory."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from training.hf.weights import WeightsError
from webapp.registry.models import RegisteredModel
from webapp.registry.services import RegistryError, export_model


class Command(BaseCommand):
    help = "Export a registered model as a Hugging Face directory that transformers (and HF servers) load."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("out_dir")
        parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")

    def handle(self, *args, name, out_dir, dtype, **options):
        model = RegisteredModel.objects.filter(name=name).first()
        if model is None:
            known = ", ".join(RegisteredModel.objects.values_list("name", flat=True)) or "none"
            raise CommandError(f"No registered model named {name!r} (registered: {known}).")
        try:
            path = export_model(model=model, out_dir=out_dir, dtype=dtype)
        except (RegistryError, WeightsError) as error:
            raise CommandError(str(error)) from error
        self.stdout.write(f"Exported {name} to {path}")
