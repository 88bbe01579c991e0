"""Pair mining, the held-out evaluation, and the train_embeddings command end to end (tiny run)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from training.embeddings.evaluation import (
    HELD_OUT_STDLIB_MODULES,
    RetrievalQuery,
    bm25_ranker,
    keyword_ranker,
    retrieval_metrics,
    retrieval_set_build,
    stdlib_directory,
)
from training.embeddings.finetune import (
    EmbeddingFinetuneConfig,
    batches_without_duplicates,
    default_excluded_paths,
    default_source_roots,
)
from training.embeddings.mining import (
    TrainingPair,
    docstring_summary,
    iter_functions,
    iter_python_files,
    mine_pairs,
    split_identifier,
    strip_docstrings,
)

LIBRARY = '''"""Inventory helpers."""


class Warehouse:
    """A place that stores boxes."""

    def count_boxes_on_shelf(self, shelf):
        """Count how many boxes are stored on the given shelf."""
        # skip shelves that were never registered in the warehouse
        if shelf not in self.shelves:
            return 0
        return len(self.shelves[shelf])


def total_weight_in_kilograms(boxes):
    """Add up the weight of every box and convert grams to kilograms."""
    grams = 0
    for box in boxes:
        grams = grams + box.weight
    return grams / 1000


def only_docstring():
    """Nothing else lives here at all."""
'''


def write_library(root: Path, copies: int = 1) -> Path:
    package = root / "inventory"
    package.mkdir(parents=True)
    for index in range(copies):
        text = LIBRARY.replace("count_boxes_on_shelf", f"count_boxes_on_shelf_{index}").replace(
            "total_weight_in_kilograms", f"total_weight_in_kilograms_{index}"
        )
        (package / f"module_{index}.py").write_text(text)
    return package


def test_strip_docstrings_keeps_code_valid_and_drops_every_docstring():
    stripped = strip_docstrings(LIBRARY)
    tree = ast.parse(stripped)
    assert all(ast.get_docstring(node) is None for node in ast.walk(tree)
               if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef))
    assert "def only_docstring():\n    ..." in stripped
    assert "# skip shelves" in stripped


def test_summaries_and_identifier_words():
    assert docstring_summary("Count boxes.\n\n    Details here.") is None
    assert docstring_summary("Count the boxes on\n  a :class:`Shelf` quickly.\n\nMore.") == (
        "Count the boxes on a Shelf quickly."
    )
    assert split_identifier("parse_HTTPDate") == "parse http date"
    assert split_identifier("__init__") == "init"


def test_mined_pairs_cover_every_kind_and_render_like_index_chunks(tmp_path):
    root = write_library(tmp_path, copies=6)
    pairs = mine_pairs(roots=[root], max_pairs=200, seed=0, max_pairs_per_file=20)
    kinds = {pair.kind for pair in pairs}
    assert kinds == {"docstring", "comment", "name", "bug"}
    docstring = next(p for p in pairs if p.kind == "docstring" and "weight" in p.query)
    assert docstring.code.startswith("inventory/module_")
    assert '"""' not in docstring.code
    comment = next(p for p in pairs if p.kind == "comment")
    assert comment.query == "skip shelves that were never registered in the warehouse"
    assert comment.query not in comment.code
    bug = next(p for p in pairs if p.kind == "bug")
    original = next(f for f in iter_functions(path=bug.code.split()[0], source=(tmp_path / bug.code.split()[0]).read_text())
                    if f.symbol == bug.code.split()[1])
    assert bug.code.split("\n", 1)[1] != original.code
    assert any(word in bug.query for word in ("Fix", "Bug", "broken", "Repair"))
    quota = mine_pairs(roots=[root], max_pairs=10, seed=0, kind_fractions={"docstring": 1.0})
    assert {pair.kind for pair in quota} == {"docstring"} and len(quota) == 10
    with pytest.raises(ValueError, match="unknown pair kinds"):
        mine_pairs(roots=[root], max_pairs=10, seed=0, kind_fractions={"typo": 1.0})


def test_batches_never_hold_two_pairs_of_one_function():
    pairs = [TrainingPair(f"q{i}", f"c{i}", "name", f"group{i % 5}") for i in range(40)]
    batches = batches_without_duplicates(pairs, batch_size=4, seed=0)
    assert batches and all(len(batch) == 4 for batch in batches)
    assert all(len({pair.group for pair in batch}) == 4 for batch in batches)
    assert sum(len(batch) for batch in batches) == 40


def test_default_mining_covers_the_stdlib_but_never_the_held_out_modules():
    roots = [Path(root) for root in default_source_roots()]
    stdlib = stdlib_directory()
    assert stdlib in roots
    mined = {path.resolve() for path in iter_python_files(roots, excluded=[Path(p) for p in default_excluded_paths()])}
    held_out = {(stdlib / module).resolve() for module in HELD_OUT_STDLIB_MODULES}
    assert len(held_out) == len(HELD_OUT_STDLIB_MODULES) and all(path.is_file() for path in held_out)
    assert not mined & held_out
    # the rest of the standard library is mined (e.g. json/scanner.py beside the held-out json/decoder.py)
    assert (stdlib / "json" / "scanner.py").resolve() in mined
    assert not any((stdlib / "site-packages") in path.parents for path in mined)


def test_retrieval_set_hides_docstrings_and_metrics_count_ranks():
    retrieval_set = retrieval_set_build(files={"lib/inventory.py": LIBRARY}, max_queries=10, seed=0)
    assert all('"""' not in chunk.text for chunk in retrieval_set.chunks)
    by_symbol = {query.symbol: query for query in retrieval_set.queries}
    assert set(by_symbol) == {"Warehouse.count_boxes_on_shelf", "total_weight_in_kilograms", "only_docstring"}
    weight = by_symbol["total_weight_in_kilograms"]
    assert "total_weight_in_kilograms" in retrieval_set.chunks[weight.relevant_rows[0]].text
    queries = [RetrievalQuery("a", "p", "s", (3,)), RetrievalQuery("b", "p", "t", (7,)), RetrievalQuery("c", "p", "u", (1,))]
    metrics = retrieval_metrics(queries=queries, rankings=[[3, 1], [0, 1, 2, 3, 4, 5, 7], [9]])
    assert (metrics.recall_at_1, metrics.recall_at_5, metrics.recall_at_10) == pytest.approx((1 / 3, 1 / 3, 2 / 3))
    assert metrics.mrr_at_10 == pytest.approx((1 + 1 / 7) / 3)
    for ranker in (bm25_ranker(retrieval_set.chunks), keyword_ranker(retrieval_set.chunks)):
        assert ranker("weight of boxes in kilograms")[0] == weight.relevant_rows[0]


def test_finetune_config_rejects_bad_runs(tmp_path):
    root = write_library(tmp_path / "src")
    with pytest.raises(ValueError, match="in-batch negatives"):
        EmbeddingFinetuneConfig(output_dir=tmp_path / "out", source_roots=(str(root),), batch_size=1)
    with pytest.raises(ValueError, match="sum to 1"):
        EmbeddingFinetuneConfig(output_dir=tmp_path / "out", source_roots=(str(root),),
                                kind_fractions=(("docstring", 0.5),))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a previous train_embeddings checkpoint"):
        EmbeddingFinetuneConfig(output_dir=occupied, source_roots=(str(root),))
    with pytest.raises(CommandError, match="below batch_size"):
        call_command("train_embeddings", "--output", str(tmp_path / "o"), "--source", str(root), "--max-pairs", "4",
                     "--batch-size", "8")


def test_train_embeddings_saves_a_checkpoint_that_search_can_select(tmp_path, settings, capsys):
    from sandboxes.semantic.config import SemanticSearchConfig
    from sandboxes.semantic.encoder import encode_texts, encoder_fingerprint, load_encoder

    root = write_library(tmp_path / "src", copies=8)
    output = tmp_path / "encoder"
    call_command("train_embeddings", "--output", str(output), "--source", str(root), "--max-pairs", "20",
                 "--batch-size", "8", "--max-seq-length", "64", "--learning-rate", "5e-5")
    printed = capsys.readouterr().out
    assert "step 2/2" in printed and f"SEMANTIC_ENCODER={output.resolve()}" in printed
    metadata = json.loads((output / "flowstate_finetune.json").read_text())
    assert metadata["result"]["steps"] == 2 and len(metadata["losses"]) == 2
    assert all(np.isfinite(metadata["losses"]))

    settings.SEMANTIC_ENCODER = str(output)
    config = SemanticSearchConfig.from_environment()
    assert config.encoder_path == str(output)
    assert encoder_fingerprint(config.encoder_path) != encoder_fingerprint(SemanticSearchConfig().encoder_path)
    tuned = encode_texts(encoder=load_encoder(path=str(output), max_seq_length=64), texts=["count boxes"], batch_size=1)
    base = encode_texts(encoder=load_encoder(path=SemanticSearchConfig().encoder_path, max_seq_length=64),
                        texts=["count boxes"], batch_size=1)
    assert tuned.shape == base.shape == (1, 384)
    assert not np.allclose(tuned, base, atol=1e-4), "training must have moved the weights"
