"""`manage.py pretrain`: continued pretraining of the policy model (see training.train.pretrain)."""

from django.core.management.base import BaseCommand, CommandError

from training.train.cli import add_loop_arguments, loop_config_from_options, print_step
from training.train.distributed import init_distributed, shutdown_distributed
from training.train.loop import TrainConfigError
from training.train.pretrain import PretrainConfig, pretrain


class Command(BaseCommand):
    help = "Continued pretraining on the stdlib (+ registered repositories); re-run to resume."

    def add_arguments(self, parser):
        add_loop_arguments(parser, steps=200, batch_size=8, lr=1e-3)
        parser.add_argument("--model", default="tiny", help="Model preset for a fresh model.")
        parser.add_argument("--init-checkpoint", default=None, help="Checkpoint to continue pretraining from.")
        parser.add_argument("--tokenizer", default=None, help="tokenizer.json for a fresh model.")
        parser.add_argument("--extra-dir", action="append", default=[], help="Repository path to add (repeatable).")
        parser.add_argument("--no-stdlib", action="store_true", help="Leave the stdlib out of the corpus.")
        parser.add_argument("--corpus-max-bytes", type=int, default=2_000_000)
        parser.add_argument("--seq-len", type=int, default=256)
        parser.add_argument(
            "--data",
            choices=("code", "induction"),
            default="code",
            help="code: the corpus; induction: synthetic copy windows (warm-up for a fresh model before SFT).",
        )

    def handle(self, *args, **options):
        context = init_distributed()
        completed = False
        try:
            config = PretrainConfig(
                run_dir=options["run_dir"],
                model=options["model"],
                init_checkpoint=options["init_checkpoint"],
                tokenizer=options["tokenizer"],
                extra_dirs=tuple(options["extra_dir"]),
                include_stdlib=not options["no_stdlib"],
                corpus_max_bytes=options["corpus_max_bytes"],
                seq_len=options["seq_len"],
                data=options["data"],
                loop=loop_config_from_options(options, world_size=context.world_size),
            )
            result = pretrain(config, context=context, on_step=print_step(self.stdout.write) if context.is_main else None)
            completed = True
        except (TrainConfigError, ValueError, FileNotFoundError) as error:
            raise CommandError(str(error)) from error
        finally:
            shutdown_distributed(context, wait_for_peers=completed)
        if context.is_main:
            self.stdout.write(self.style.SUCCESS(f"final checkpoint: {result.final_checkpoint}"))
