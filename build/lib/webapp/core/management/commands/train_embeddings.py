"""Fine-tune the semantic search encoder on (description, code) pairs mined from code on this machine."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from training.embeddings.finetune import EmbeddingFinetuneConfig, default_source_roots, embeddings_finetune


class Command(BaseCommand):
    help = (
        "Contrastively fine-tune the code search encoder (in-batch negatives) and save a checkpoint; "
        "select it with SEMANTIC_ENCODER=<output>."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--output",
            default=str(Path(settings.STATE_DIR) / "embeddings" / "code-search"),
            help="Directory for the fine-tuned model (default: var/embeddings/code-search).",
        )
        parser.add_argument("--base", default=None, help="Model directory to start from (default: bundled MiniLM).")
        parser.add_argument(
            "--source", action="append", default=None,
            help="Directory of Python code to mine; repeat for several (default: installed third-party packages "
            "and the standard library).",
        )
        parser.add_argument(
            "--exclude", action="append", default=None,
            help="File or directory never mined; repeat for several (default: the retrieval benchmark's "
            "held-out stdlib modules and the stdlib's site-packages).",
        )
        parser.add_argument("--max-pairs", type=int, default=3000)
        parser.add_argument("--batch-size", type=int, default=32)
        parser.add_argument("--epochs", type=int, default=1)
        parser.add_argument("--learning-rate", type=float, default=3e-5)
        parser.add_argument("--max-seq-length", type=int, default=128)
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, *args, **options):
        overrides = {}
        if options["base"]:
            overrides["base_encoder"] = options["base"]
        if options["exclude"]:
            overrides["excluded_paths"] = tuple(options["exclude"])
        try:
            config = EmbeddingFinetuneConfig(
                output_dir=Path(options["output"]),
                source_roots=tuple(options["source"] or default_source_roots()),
                max_pairs=options["max_pairs"],
                batch_size=options["batch_size"],
                epochs=options["epochs"],
                learning_rate=options["learning_rate"],
                max_seq_length=options["max_seq_length"],
                seed=options["seed"],
                **overrides,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc

        def report(step: int, total: int, loss: float) -> None:
            if step == 1 or step % 10 == 0 or step == total:
                self.stdout.write(f"step {step}/{total} loss {loss:.4f}")

        result = embeddings_finetune(config=config, on_step=report)
        self.stdout.write(self.style.SUCCESS(
            f"saved {result.output_dir}: {result.pairs} pairs {result.pairs_by_kind}, {result.steps} steps, "
            f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}, {result.seconds:.0f}s. "
            f"Use it with SEMANTIC_ENCODER={result.output_dir.resolve()}"
        ))
