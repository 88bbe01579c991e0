"""Distilled students of the search encoder: the format's round trip and refusals, and distill_encoder.

A student directory names its teacher and the teacher's weights' sha256 and holds only the trained
layers; these tests tamper with each part the way a bad download, a hand edit or a swapped teacher
would, and check that loading refuses with a message naming the problem instead of indexing with a
half-built model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError, default_encoder_path
from sandboxes.semantic.encoder import TorchTextEncoder, load_encoder, sentence_transformer_load
from sandboxes.semantic.student import (
    STUDENT_FILE,
    STUDENT_WEIGHTS,
    TEACHER_BUNDLED,
    is_student,
    keep_layers,
    student_load,
    student_save,
    trained_parameters,
    transformer,
)
from training.embeddings.evaluation import held_out_files, retrieval_set_build


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    retrieval_set = retrieval_set_build(files=held_out_files(("textwrap.py", "csv.py", "heapq.py")), max_queries=20,
                                        seed=0)
    return [chunk.embedding_text() for chunk in retrieval_set.chunks[:64]] + [q.text for q in retrieval_set.queries[:8]]


@pytest.fixture
def saved_student(tmp_path) -> Path:
    """A student of the bundled teacher with layers 0 and 5, its weights moved off the teacher's."""
    import torch

    student = keep_layers(sentence_transformer_load(default_encoder_path()), [0, 5])
    with torch.no_grad():
        for name, parameter in transformer(student).named_parameters():
            if name.startswith("encoder.layer.1.output.dense"):
                parameter.add_(0.01)
    student_save(model=student, destination=tmp_path / "student", teacher=TEACHER_BUNDLED, layers=[0, 5],
                 made_by={"test": True})
    return tmp_path / "student"


def test_a_saved_student_loads_back_to_the_same_vectors(saved_student, sample_texts):
    import torch

    loaded = student_load(saved_student)
    assert len(transformer(loaded).encoder.layer) == 2
    assert transformer(loaded).config.num_hidden_layers == 2
    assert (saved_student / STUDENT_WEIGHTS).stat().st_mode & 0o044 == 0o044, "shipped weights must be readable"
    names = set(trained_parameters(loaded))
    assert names and not any(name.startswith("embeddings.") for name in names)
    # The embeddings are the teacher's own; the moved layer is the saved one, not the teacher's layer 5.
    teacher = sentence_transformer_load(default_encoder_path())
    assert torch.equal(transformer(loaded).embeddings.word_embeddings.weight,
                       transformer(teacher).embeddings.word_embeddings.weight)
    assert not torch.equal(transformer(loaded).encoder.layer[1].output.dense.weight,
                           transformer(teacher).encoder.layer[5].output.dense.weight)
    again = TorchTextEncoder(student_load(saved_student)).encode(sample_texts, batch_size=16)
    np.testing.assert_array_equal(TorchTextEncoder(loaded).encode(sample_texts, batch_size=16), again)


def _rewrite(directory: Path, **changes) -> None:
    meta = json.loads((directory / STUDENT_FILE).read_text())
    meta.update(changes)
    (directory / STUDENT_FILE).write_text(json.dumps(meta))


def test_a_student_of_other_teacher_weights_is_refused(saved_student):
    _rewrite(saved_student, teacher_sha256="0" * 64)
    with pytest.raises(SemanticSearchError, match="other teacher weights"):
        student_load(saved_student)


def test_a_student_naming_another_directory_as_teacher_is_checked_against_that_directory(saved_student, tmp_path):
    """A teacher given by path is hashed where it lies: a copy with one byte changed is refused."""
    teacher = tmp_path / "teacher"
    shutil.copytree(default_encoder_path(), teacher)
    _rewrite(saved_student, teacher=str(teacher))
    assert len(transformer(student_load(saved_student)).encoder.layer) == 2
    weights = next(teacher.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(SemanticSearchError, match="other teacher weights"):
        student_load(saved_student)


def test_missing_or_extra_tensors_are_named(saved_student):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved_student / STUDENT_WEIGHTS))
    dropped = sorted(tensors)[0]
    partial = {name: tensor for name, tensor in tensors.items() if name != dropped}
    save_file(partial, str(saved_student / STUDENT_WEIGHTS))
    with pytest.raises(SemanticSearchError, match="missing") as missing:
        student_load(saved_student)
    assert dropped in str(missing.value)
    save_file({**tensors, "encoder.layer.7.attention.self.query.weight": tensors[dropped].clone()},
              str(saved_student / STUDENT_WEIGHTS))
    with pytest.raises(SemanticSearchError, match=r"encoder\.layer\.7"):
        student_load(saved_student)


def test_a_tensor_of_the_wrong_shape_is_refused(saved_student):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved_student / STUDENT_WEIGHTS))
    name = next(name for name in tensors if name.endswith("query.weight"))
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(saved_student / STUDENT_WEIGHTS))
    with pytest.raises(RuntimeError, match="size mismatch"):
        student_load(saved_student)


@pytest.mark.parametrize("damage", [
    lambda d: (d / STUDENT_FILE).write_text("{not json"),
    lambda d: (d / STUDENT_FILE).write_text(json.dumps({"format": "flowstate-layer-student/1"})),
    lambda d: _rewrite(d, format="someone-elses/9"),
    lambda d: _rewrite(d, layers=[0, 9]),
    lambda d: _rewrite(d, layers=[5, 5]),
    lambda d: _rewrite(d, layers="0,5"),
])
def test_a_damaged_description_is_refused_before_any_weights_load(saved_student, damage):
    damage(saved_student)
    with pytest.raises(SemanticSearchError):
        student_load(saved_student)


def test_distill_encoder_trains_a_student_that_search_can_select(tmp_path, settings, capsys):
    """The command end to end on a tiny library: a loadable student, closer to its teacher than before
    training, selectable with SEMANTIC_ENCODER, fine-tunable by train_embeddings."""
    from django.core.management import call_command

    from tests.semantic.test_embeddings import write_library

    library = write_library(tmp_path / "src", copies=12)
    output = tmp_path / "student"
    call_command("distill_encoder", "--output", str(output), "--layers", "0,5", "--pairs", "16", "--chunks", "16",
                 "--batch-size", "8", "--epochs", "3", "--learning-rate", "5e-4", "--max-seq-length", "64",
                 source=[str(library)])
    printed = capsys.readouterr().out
    assert "step 3/3" in printed and "mean cosine to the teacher" in printed
    meta = json.loads((output / STUDENT_FILE).read_text())
    assert meta["layers"] == [0, 5] and meta["made_by"]["result"]["steps"] == 3
    result = meta["made_by"]["result"]
    assert np.isfinite(result["last_loss"]) and result["last_loss"] < result["first_loss"]

    settings.SEMANTIC_ENCODER = str(output)
    config = SemanticSearchConfig.from_environment()
    assert config.encoder_path == str(output) and is_student(config.encoder_path)
    vectors = TorchTextEncoder(load_encoder(path=str(output), max_seq_length=64)).encode(["count boxes"], batch_size=1)
    assert vectors.shape == (1, 384)
    call_command("train_embeddings", "--output", str(tmp_path / "tuned"), "--base", str(output), "--source",
                 str(library), "--max-pairs", "16", "--batch-size", "8", "--max-seq-length", "64")
    tuned = sentence_transformer_load(str(tmp_path / "tuned"))
    assert len(transformer(tuned).encoder.layer) == 2  # a fine-tuned student stays a two-layer model


def test_distill_config_refuses_bad_runs(tmp_path):
    from training.embeddings.distill import EncoderDistillConfig

    with pytest.raises(ValueError, match="similarity_weight"):
        EncoderDistillConfig(output_dir=tmp_path / "o", similarity_weight=float("nan"))
    with pytest.raises(ValueError, match="batch_size"):
        EncoderDistillConfig(output_dir=tmp_path / "o", pairs=4)
    with pytest.raises(ValueError, match="teacher"):
        EncoderDistillConfig(output_dir=tmp_path / "o", teacher=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="layers"):
        EncoderDistillConfig(output_dir=tmp_path / "o", layers=())
