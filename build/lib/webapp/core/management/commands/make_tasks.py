"""manage.py make_tasks: write toy or real-tier tasks as JSON lines (real ones validated in sandboxes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Generate toy-tier tasks deterministically by seed, or mine real-tier tasks from the CPython stdlib "
        "(kept only when validated fail-to-pass in a sandbox), and write them as JSON lines."
    )

    def add_arguments(self, parser):
        parser.add_argument("--tier", choices=("toy", "real"), default="toy")
        parser.add_argument("--split", choices=("train", "heldout"), default=None)
        parser.add_argument("--count", type=int, default=10, help="toy: tasks to write")
        parser.add_argument("--start", type=int, default=0, help="toy: index of the first task in the split")
        parser.add_argument("--modules", default="", help="real: comma-separated stdlib modules (default: built-in list)")
        parser.add_argument("--candidates", type=int, default=6, help="real: mutations tried per module")
        parser.add_argument("--seed", type=int, default=0, help="real: seed of the mutation choice")
        parser.add_argument("--output", default="-", help="file to write (default: stdout); real tier appends new tasks")

    def handle(self, *args, **options):
        from training.tasks.base import CodingTask, TaskError

        try:
            tasks = self._toy(options) if options["tier"] == "toy" else self._real(options)
        except TaskError as error:
            raise CommandError(str(error)) from error
        lines = [task.to_json() + "\n" for task in tasks]
        if options["output"] == "-":
            sys.stdout.writelines(lines)
            return
        path = Path(options["output"])
        path.parent.mkdir(parents=True, exist_ok=True)
        existing = []
        if options["tier"] == "real" and path.exists():
            existing = [CodingTask.from_json(line) for line in path.read_text().splitlines() if line.strip()]
        with open(path, "a" if existing else "w") as handle:
            handle.writelines(lines)
        self.stderr.write(f"wrote {len(tasks)} {options['tier']} tasks to {path}")

    def _toy(self, options):
        from training.tasks.toy import generate_toy_task, toy_task_seeds

        seeds = toy_task_seeds(split=options["split"] or "train", count=options["count"], start=options["start"])
        return [generate_toy_task(seed) for seed in seeds]

    def _real(self, options):
        from sandboxes import get_backend
        from training.tasks.base import CodingTask
        from training.tasks.real import DEFAULT_STDLIB_MODULES, RealTierConfig, mine_stdlib_tasks

        known: frozenset[str] = frozenset()
        if options["output"] != "-" and Path(options["output"]).exists():
            lines = Path(options["output"]).read_text().splitlines()
            known = frozenset(CodingTask.from_json(line).task_id.rsplit("-", 1)[1] for line in lines if line.strip())
        modules = tuple(name.strip() for name in options["modules"].split(",") if name.strip()) or DEFAULT_STDLIB_MODULES
        config = RealTierConfig(
            modules=modules, candidates_per_module=options["candidates"], seed=options["seed"], split=options["split"]
        )
        report = mine_stdlib_tasks(
            config=config, backend=get_backend(settings.SANDBOX_BACKEND), known_fingerprints=known,
            on_progress=lambda line: self.stderr.write(line),
        )
        for rejected in report.rejected:
            self.stderr.write(f"rejected: {json.dumps(rejected)[:300]}")
        return report.tasks
