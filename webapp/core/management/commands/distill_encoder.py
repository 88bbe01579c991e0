"""Distil the semantic search encoder into fewer layers: about twice the indexing speed, some recall lost."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from training.embeddings.distill import EncoderDistillConfig, embeddings_distill


class Command(BaseCommand):
    help = (
        "Train a student that keeps some of the teacher's layers to reproduce its vectors on code, and save it "
        "(student.json + layers.safetensors); select it with SEMANTIC_ENCODER=<output>."
    )

    def add_arguments(self, parser):
        defaults = EncoderDistillConfig.__dataclass_fields__
        parser.add_argument("--output", default=str(defaults["output_dir"].default),
                            help="Student directory (default: var/embeddings/minilm-l3).")
        parser.add_argument("--teacher", default=defaults["teacher"].default,
                            help="bundled:all-MiniLM-L6-v2 (default) or a sentence-transformers directory.")
        parser.add_argument("--source", action="append", default=None,
                            help="Directory of Python code to sample; repeat for several (default: as train_embeddings).")
        parser.add_argument("--layers", default="0,3,5", help="Teacher layers kept, comma-separated (default 0,3,5).")
        for name in ("pairs", "chunks", "epochs", "batch_size", "max_seq_length", "seed"):
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name].default)
        parser.add_argument("--init", default=None, help="A student directory to continue training from.")
        for name in ("learning_rate", "similarity_weight", "contrastive_weight"):
            parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=defaults[name].default)

    def handle(self, *args, **options):
        overrides = {"source_roots": tuple(options["source"])} if options["source"] else {}
        try:
            layers = tuple(int(part) for part in options["layers"].split(","))
            config = EncoderDistillConfig(
                output_dir=Path(options["output"]), teacher=options["teacher"], layers=layers,
                pairs=options["pairs"], chunks=options["chunks"], epochs=options["epochs"],
                batch_size=options["batch_size"], max_seq_length=options["max_seq_length"], seed=options["seed"],
                learning_rate=options["learning_rate"], similarity_weight=options["similarity_weight"],
                contrastive_weight=options["contrastive_weight"], init=options["init"], **overrides,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc

        def report(step: int, total: int, loss: float) -> None:
            if step == 1 or step % 20 == 0 or step == total:
                self.stdout.write(f"step {step}/{total} loss {loss:.5f}", ending="\n")
                self.stdout.flush()

        result = embeddings_distill(config=config, on_step=report)
        self.stdout.write(self.style.SUCCESS(
            f"saved {result.output_dir}: {result.texts} texts, {result.steps} steps, loss {result.first_loss:.4f} -> "
            f"{result.last_loss:.4f}, mean cosine to the teacher {result.mean_cosine_to_teacher:.4f}, "
            f"{result.seconds:.0f}s"
        ))
