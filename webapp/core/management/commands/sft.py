"""`manage.py sft`: supervised fine-tuning on agent trajectories (see training.train.sft)."""

from django.core.management.base import BaseCommand, CommandError

from training.train.cli import add_loop_arguments, loop_config_from_options, print_step
from training.train.distributed import init_distributed, shutdown_distributed
from training.train.loop import TrainConfigError
from training.train.scripted_expert import ExpertTrajectoryError
from training.train.sft import SFTConfig, sft
from webapp.agents.selectors import trajectories_for_sft


class Command(BaseCommand):
    help = "Fine-tune on recorded, JSONL and scripted-expert trajectories (assistant tokens only); re-run to resume."

    def add_arguments(self, parser):
        add_loop_arguments(parser, steps=100, batch_size=4, lr=5e-4)
        parser.add_argument("--init-checkpoint", default=None, help="Checkpoint to fine-tune.")
        parser.add_argument("--model", default="tiny", help="Preset for a fresh model (without --init-checkpoint).")
        parser.add_argument("--database-limit", type=int, default=0, help="Recorded trajectories to read (0: none).")
        parser.add_argument("--jsonl", action="append", default=[], help="JSONL trajectory file (repeatable).")
        parser.add_argument("--expert-tasks", type=int, default=0, help="Toy tasks solved by the scripted expert.")
        parser.add_argument("--expert-seed-start", type=int, default=0)
        parser.add_argument("--sandbox-backend", default=None, help="Sandbox backend for the expert.")
        parser.add_argument("--max-seq-len", type=int, default=4096)
        parser.add_argument(
            "--context-loss",
            action="store_true",
            help="Also train on user and tool messages (teaches a fresh model to copy from its context).",
        )

    def handle(self, *args, **options):
        context = init_distributed()
        completed = False
        try:
            config = SFTConfig(
                run_dir=options["run_dir"],
                init_checkpoint=options["init_checkpoint"],
                model=options["model"],
                database_limit=options["database_limit"],
                jsonl_files=tuple(options["jsonl"]),
                expert_tasks=options["expert_tasks"],
                expert_seed_start=options["expert_seed_start"],
                sandbox_backend=options["sandbox_backend"],
                max_seq_len=options["max_seq_len"],
                context_loss=options["context_loss"],
                loop=loop_config_from_options(options, world_size=context.world_size),
            )
            result = sft(
                config,
                context=context,
                database_trajectories=lambda limit: trajectories_for_sft(limit=limit),
                on_step=print_step(self.stdout.write) if context.is_main else None,
            )
            completed = True
        except (TrainConfigError, ExpertTrajectoryError, ValueError, FileNotFoundError) as error:
            raise CommandError(str(error)) from error
        finally:
            shutdown_distributed(context, wait_for_peers=completed)
        if context.is_main:
            self.stdout.write(self.style.SUCCESS(f"final checkpoint: {result.final_checkpoint}"))
