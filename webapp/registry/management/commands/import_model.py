"""manage.py import_model SOURCE --name NAME: register a Hugging Face directory or a GGUF file."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from training.hf.families import UnsupportedModelError
from training.hf.loading import DTYPES, HFDirectoryError
from training.hf.weights import WeightsError
from webapp.accounts.models import Team
from webapp.registry.services import RegistryError, import_model


class Command(BaseCommand):
    help = (
        "Import a Hugging Face directory (config.json, model.safetensors or shards with their index, "
        "tokenizer.json, tokenizer_config.json with the chat template, generation_config.json) into the "
        "model registry, or a GGUF file (or a directory holding one), dequantised to --dtype. Weights are "
        "checked shard by shard against Flowstate's model of the family."
    )

    def add_arguments(self, parser):
        parser.add_argument("directory", help="a Hugging Face directory, a .gguf file, or a directory holding one")
        parser.add_argument("--name", required=True, help="registry name (a slug) clients use as `model`")
        parser.add_argument("--owner", default=None, help="username; without it every signed-in user may use it")
        parser.add_argument("--team", default=None, help="team name whose members may use it (needs --owner)")
        parser.add_argument("--skip-weight-check", action="store_true", help="do not load the weights at import")
        parser.add_argument(
            "--dtype", default="float32", choices=sorted(DTYPES), help="weights' dtype when dequantising a GGUF file"
        )

    def handle(self, *args, directory, name, owner, team, skip_weight_check, dtype, **options):
        owner_user = team_obj = None
        if owner:
            owner_user = get_user_model().objects.filter(username=owner).first()
            if owner_user is None:
                raise CommandError(f"No user named {owner!r}.")
        if team:
            if owner_user is None:
                raise CommandError("--team needs --owner (a team shares its owner's model).")
            team_obj = Team.objects.filter(name=team, members=owner_user).first()
            if team_obj is None:
                raise CommandError(f"{owner!r} is not a member of a team named {team!r}.")
        try:
            model = import_model(
                source=directory, name=name, owner=owner_user, team=team_obj, verify_weights=not skip_weight_check,
                dtype=dtype,
            )
        except (RegistryError, UnsupportedModelError, HFDirectoryError, WeightsError) as error:
            raise CommandError(str(error)) from error
        self.stdout.write(
            f"Registered {model.name}: {model.family}, {model.total_parameters:,} parameters "
            f"({model.active_parameters:,} active), {model.dtype}, sha256 {model.checksum[:16]}..., "
            f"files in {model.directory}"
            + (f" (from GGUF, sha256 {model.source_checksum[:16]}...)" if model.source_format == "gguf" else "")
        )
