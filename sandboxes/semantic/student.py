"""Layer-dropped students of the search encoder, stored as the layers that differ from their teacher.

A student keeps some of the teacher's transformer layers (``layers``, teacher indices) and is trained to
reproduce the teacher's vectors (``training.embeddings.distill``); its word, position and type
embeddings stay frozen, so they are the teacher's own. A student directory therefore holds only
``student.json`` (teacher, its weights' sha256, the kept layers, how it was made) and
``layers.safetensors`` (every trained parameter, keyed as in the student's transformer). Loading builds
the teacher, keeps those layers and loads the trained weights over them, in memory: the ~47 MB
embedding matrix is not stored twice (a student is ~22 MB), and a teacher whose weights changed is
refused, not silently mixed with layers trained against another.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandboxes.semantic.config import SemanticSearchError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

STUDENT_FILE = "student.json"
STUDENT_WEIGHTS = "layers.safetensors"
STUDENT_FORMAT = "flowstate-layer-student/1"
TEACHER_BUNDLED = "bundled:all-MiniLM-L6-v2"
"""``teacher`` of a student of the bundled MiniLM (a path would not survive a move of the virtualenv)."""


def is_student(path: str | Path) -> bool:
    return (Path(path) / STUDENT_FILE).is_file()


def student_layers(path: str | Path) -> list[int]:
    """The teacher layers the student at ``path`` keeps."""
    return [int(index) for index in json.loads((Path(path) / STUDENT_FILE).read_text())["layers"]]


def teacher_path(reference: str) -> str:
    """The directory a student's ``teacher`` names: the bundled MiniLM, or a model directory."""
    if reference == TEACHER_BUNDLED:
        from sandboxes.semantic.config import default_encoder_path

        return default_encoder_path()
    return reference


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over the model directory's weight files, in name order."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors")) + sorted(Path(model_dir).glob("*.bin"))
    if not files:
        raise SemanticSearchError(f"{model_dir} holds no *.safetensors or *.bin weights")
    for weights in files:
        with weights.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def transformer(model: SentenceTransformer) -> Any:
    """The Hugging Face model inside a sentence-transformers Transformer + Pooling pipeline."""
    return model[0].auto_model


def keep_layers(model: SentenceTransformer, layers: list[int]) -> SentenceTransformer:
    """A copy of ``model`` with only the transformer layers ``layers`` (in that order)."""
    import torch

    student = copy.deepcopy(model)
    inner = transformer(student)
    count = len(inner.encoder.layer)
    if not layers or any(not 0 <= index < count for index in layers) or len(set(layers)) != len(layers):
        raise SemanticSearchError(f"layers {layers} must be distinct indices below the teacher's {count} layers")
    inner.encoder.layer = torch.nn.ModuleList([inner.encoder.layer[index] for index in layers])
    inner.config.num_hidden_layers = len(layers)
    return student


def trained_parameters(model: SentenceTransformer) -> dict[str, Any]:
    """The student's parameters that training changes: everything but the frozen embeddings."""
    return {name: tensor for name, tensor in transformer(model).state_dict().items()
            if not name.startswith("embeddings.")}


def student_save(*, model: SentenceTransformer, destination: Path, teacher: str, layers: list[int],
                 made_by: dict[str, Any]) -> None:
    """Write ``student.json`` and ``layers.safetensors`` (float32) into ``destination``."""
    from safetensors.torch import save_file

    source = teacher_path(teacher)
    destination.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().float().contiguous() for name, tensor in trained_parameters(model).items()}
    save_file(tensors, str(destination / STUDENT_WEIGHTS))
    (destination / STUDENT_WEIGHTS).chmod(0o644)  # safetensors writes 0600; other processes read it
    meta = {"format": STUDENT_FORMAT, "teacher": teacher, "teacher_sha256": weights_sha256(source),
            "layers": layers, "max_seq_length": model.max_seq_length, "made_by": made_by}
    (destination / STUDENT_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def student_load(path: str | Path) -> SentenceTransformer:
    """The student at ``path``, built from its teacher (checked by sha256) and its trained layers."""
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    root = Path(path)
    try:
        meta = json.loads((root / STUDENT_FILE).read_text())
        teacher, expected, layers = meta["teacher"], meta["teacher_sha256"], [int(i) for i in meta["layers"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SemanticSearchError(f"{root / STUDENT_FILE} is not a readable student description: {exc}") from exc
    if meta.get("format") != STUDENT_FORMAT:
        raise SemanticSearchError(f"{root / STUDENT_FILE}: format {meta.get('format')!r} is not {STUDENT_FORMAT}")
    source = teacher_path(str(teacher))
    if weights_sha256(source) != expected:
        raise SemanticSearchError(
            f"the student at {root} was trained against other teacher weights than those at {source} "
            "(sha256 differs); distill it again (manage.py distill_encoder) or point SEMANTIC_ENCODER elsewhere"
        )
    student = keep_layers(SentenceTransformer(source, device="cpu", local_files_only=True), layers)
    trained = load_file(str(root / STUDENT_WEIGHTS))
    expected_names = set(trained_parameters(student))
    if set(trained) != expected_names:
        missing, unknown = sorted(expected_names - set(trained)), sorted(set(trained) - expected_names)
        raise SemanticSearchError(f"{root / STUDENT_WEIGHTS}: missing {missing[:5]}, unexpected {unknown[:5]}")
    transformer(student).load_state_dict(trained, strict=False)
    if isinstance(meta.get("max_seq_length"), int):
        student.max_seq_length = meta["max_seq_length"]
    return student
