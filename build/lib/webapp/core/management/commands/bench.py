"""manage.py bench --suite NAME --policy X: evaluate a policy on a task suite and store the result."""

from __future__ import annotations

import json

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError


def _tool_names(text: str) -> tuple[str, ...]:
    """"a, b" -> ("a", "b") (names are checked against the tool list by BenchConfig)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


class Command(BaseCommand):
    help = (
        "Run the CursorBench-like evaluation: pass@1, pass@k, tokens, tool calls and wall time per task, "
        "stored as a BenchmarkRun and shown on /experiments/benchmarks/."
    )

    def add_arguments(self, parser):
        parser.add_argument("--suite", required=True, help="toy-heldout-N, toy-validation-N or toy-train-N")
        parser.add_argument(
            "--policy",
            required=True,
            help="scripted | checkpoint:PATH | openai:MODEL@BASE_URL (key: OPENAI_API_KEY)",
        )
        parser.add_argument("--attempts", type=int, default=1, help="attempts per task (k of pass@k)")
        parser.add_argument(
            "--owner", default=None, help="username owning the result (default: first superuser)"
        )
        parser.add_argument("--max-turns", type=int, default=8)
        parser.add_argument("--max-tokens-per-turn", type=int, default=256)
        parser.add_argument("--temperature", type=float, default=0.7)
        parser.add_argument("--concurrency", type=int, default=2)
        parser.add_argument(
            "--exclude-tools", default="",
            help="comma-separated tools not offered (this changes the prompt), e.g. semantic_search",
        )
        parser.add_argument(
            "--disable-tools", default="",
            help="comma-separated tools offered but refused when called (same prompt), e.g. semantic_search",
        )

    def handle(self, *args, **options):
        from webapp.experiments.services import benchmark_run_create, benchmark_run_execute

        users = get_user_model().objects
        owner = (
            users.filter(username=options["owner"]).first()
            if options["owner"]
            else users.filter(is_superuser=True).order_by("pk").first()
        )
        if owner is None:
            raise CommandError("no owner: pass --owner USERNAME of an existing user (or create a superuser)")
        run_options = {
            "max_turns": options["max_turns"],
            "max_tokens_per_turn": options["max_tokens_per_turn"],
            "temperature": options["temperature"],
            "concurrency": options["concurrency"],
            "exclude_tools": _tool_names(options["exclude_tools"]),
            "disable_tools": _tool_names(options["disable_tools"]),
        }
        try:
            run = benchmark_run_create(
                owner=owner,
                suite=options["suite"],
                policy=options["policy"],
                attempts=options["attempts"],
                options=run_options,
                enqueue=False,
            )
            run = benchmark_run_execute(run_id=run.pk)
        except ValidationError as error:
            raise CommandError(" ".join(error.messages)) from error
        summary = {key: value for key, value in run.summary.items() if key != "config"}
        self.stdout.write(json.dumps(summary, indent=2))
        self.stdout.write(
            self.style.SUCCESS(
                f"benchmark run {run.pk}: pass@1 {summary['pass_at_1']} on {run.suite} ({run.policy_label})"
            )
        )
