"""manage.py expert_trajectories: solve toy training tasks with the scripted expert, write JSON lines.

Each line is {"task_id": ..., "messages": [...]}, readable by `manage.py sft --jsonl`. Trajectories are
recorded in real sandboxes and kept only when the hidden tests pass. Re-running with the same
--output skips tasks already written, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Record scripted-expert trajectories on toy training tasks as JSON lines (resumable)."

    def add_arguments(self, parser):
        parser.add_argument("--count", type=int, required=True, help="toy training tasks to solve")
        parser.add_argument("--start", type=int, default=0, help="index of the first task in the train split")
        parser.add_argument("--output", required=True, help="JSONL file; existing task ids are skipped")
        parser.add_argument("--sandbox-backend", default=None, help="backend the expert runs in")
        from training.train.scripted_expert import EDIT_TOOLS

        parser.add_argument("--edit-tool", default=EDIT_TOOLS[0], choices=EDIT_TOOLS,
                            help="tool the expert fixes the file with")

    def handle(self, *args, **options):
        from sandboxes import get_backend
        from training.tasks.base import TaskError
        from training.tasks.toy import generate_toy_task, toy_task_seeds
        from training.train.scripted_expert import ExpertTrajectoryError, expert_trajectory_create

        output = Path(options["output"])
        done = set()
        if output.exists():
            for number, line in enumerate(output.read_text().splitlines(), start=1):
                try:
                    done.add(json.loads(line)["task_id"])
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise CommandError(f"{output}:{number} is not a trajectory line ({error}); move the file away.")
        try:
            seeds = toy_task_seeds(split="train", count=options["count"], start=options["start"])
            backend = get_backend(options["sandbox_backend"])
        except (TaskError, ValueError) as error:
            raise CommandError(str(error)) from error
        output.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        with output.open("a") as sink:
            for seed in seeds:
                task = generate_toy_task(seed)
                if task.task_id in done:
                    continue
                try:
                    trajectory = expert_trajectory_create(task=task, backend=backend, edit_tool=options["edit_tool"])
                except ExpertTrajectoryError as error:
                    raise CommandError(str(error)) from error
                sink.write(json.dumps({"task_id": task.task_id, "messages": trajectory.messages}) + "\n")
                sink.flush()
                written += 1
        self.stdout.write(f"{written} written, {len(seeds) - written} already in {output}")
