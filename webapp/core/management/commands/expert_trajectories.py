"""manage.py expert_trajectories: solve toy training tasks with the scripted expert, write JSON lines.

Each line is {"task_id": ..., "messages": [...]}, readable by `manage.py sft --jsonl`. Trajectories are
recorded in real sandboxes and kept only when the hidden tests pass. Re-running with the same
--output skips tasks already written, so an interrupted run continues where it stopped.

--verify: the expert checks its fix by running the bug report's call instead of the test suite, and
with --retry-share a share of the tasks starts from a wrong fix of the faulty line, which the check
exposes and a second edit corrects (training.train.scripted_expert). Each line then also says which
(`"retry": true`).
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
        parser.add_argument("--verify", action="store_true",
                            help="check the fix with the bug report's call instead of running the test suite")
        parser.add_argument("--retry-share", type=float, default=0.0,
                            help="with --verify: share of tasks whose first fix is wrong and then corrected (0-1)")

    def handle(self, *args, **options):
        from sandboxes import get_backend
        from training.tasks.base import TaskError
        from training.tasks.toy import generate_toy_task, toy_task_seeds
        from training.train.scripted_expert import (
            ExpertTrajectoryError,
            expert_trajectory_create,
            expert_variant,
            report_check_command,
        )

        output = Path(options["output"])
        done = set()
        if output.exists():
            for number, line in enumerate(output.read_text().splitlines(), start=1):
                try:
                    done.add(json.loads(line)["task_id"])
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise CommandError(f"{output}:{number} is not a trajectory line ({error}); move the file away.") from error
        if options["retry_share"] and not options["verify"]:
            raise CommandError("--retry-share needs --verify: without the check nothing shows the first fix is wrong.")
        if not 0.0 <= options["retry_share"] <= 1.0:
            raise CommandError(f"--retry-share must lie in [0, 1], got {options['retry_share']}.")
        if options["retry_share"] and options["edit_tool"] != "edit_file":
            raise CommandError("--retry-share works with --edit-tool edit_file only.")
        try:
            seeds = toy_task_seeds(split="train", count=options["count"], start=options["start"])
            backend = get_backend(options["sandbox_backend"])
        except (TaskError, ValueError) as error:
            raise CommandError(str(error)) from error
        output.parent.mkdir(parents=True, exist_ok=True)
        written = skipped = 0
        with output.open("a") as sink:
            for seed in seeds:
                task = generate_toy_task(seed)
                if task.task_id in done:
                    continue
                if options["verify"] and report_check_command(task) is None:
                    skipped += 1  # its report's call needs shell escaping: no check command to show
                    continue
                wrong_first = expert_variant(task, retry_share=options["retry_share"]) if options["verify"] else None
                try:
                    trajectory = expert_trajectory_create(
                        task=task, backend=backend, edit_tool=options["edit_tool"], verify=options["verify"],
                        wrong_first=wrong_first,
                    )
                except (ExpertTrajectoryError, ValueError) as error:
                    raise CommandError(str(error)) from error
                line = {"task_id": task.task_id, "messages": trajectory.messages}
                if options["verify"]:
                    line["retry"] = wrong_first is not None
                sink.write(json.dumps(line) + "\n")
                sink.flush()
                written += 1
        self.stdout.write(
            f"{written} written, {len(seeds) - written - skipped} already in {output}"
            + (f", {skipped} skipped (no report call to check with)" if skipped else "")
        )
