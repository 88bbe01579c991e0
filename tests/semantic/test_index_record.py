"""An index records how its vectors were made (backend, precision, the CPU's ISA class and flags) and is rebuilt,
saying why, when this machine's encoder would make its queries' vectors another way."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from sandboxes.semantic.config import SemanticSearchConfig
from sandboxes.semantic.cpu import cpu_flags, isa_class, this_cpu
from sandboxes.semantic.index import (
    base_index_directory,
    base_index_load,
    base_index_load_or_build,
    iter_directory_files,
)

AMX_XEON_FLAGS = ("fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni "
                  "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni")
AMD_EPYC_AVX2_FLAGS = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 fma f16c avx avx2 bmi1 bmi2"


def test_the_cpu_class_names_the_kernel_family():
    amx = cpu_flags(f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: {AMX_XEON_FLAGS}\n")
    assert isa_class(amx) == "amx-bf16"
    assert {"amx_int8", "avx512_bf16", "avx512_vnni"} <= amx and "sse2" not in amx
    assert isa_class(cpu_flags(f"flags\t: {AMD_EPYC_AVX2_FLAGS}\n")) == "avx2"
    assert isa_class(frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"})) == "avx512-vnni"
    assert isa_class(frozenset({"avx2", "avx_vnni"})) == "avx2-vnni"
    assert isa_class(frozenset(), machine="aarch64") == "aarch64"
    here, flags = this_cpu()
    assert here == isa_class(frozenset(flags)) or not flags


def _build(config: SemanticSearchConfig, repository):
    return base_index_load_or_build(snapshot_id="snap-1", config=config, files=lambda: iter_directory_files(
        repository, max_file_bytes=config.chunking.max_file_bytes))


def _index_messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "sandboxes.semantic.index"]


def _rewrite_meta(config: SemanticSearchConfig, change) -> None:
    meta_path = base_index_directory(snapshot_id="snap-1", config=config) / "meta.json"
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta_path.write_text(json.dumps(meta))


@pytest.fixture
def default_config(tmp_path, encoder_cache) -> SemanticSearchConfig:
    return SemanticSearchConfig(index_root=tmp_path / "index", vector_store="memory", encoder_cache_dir=encoder_cache)


def test_the_index_records_the_encoder_path_precision_and_cpu(default_config, tiny_repository):
    built = _build(default_config, tiny_repository)
    meta = json.loads((built.directory / "meta.json").read_text())
    isa, flags = this_cpu()
    assert meta["encoder_runtime"] == {"backend": "openvino-int8", "precision": "int8+f32", "isa_class": isa,
                                       "cpu_flags": list(flags)}
    assert meta["encoder_path"] == default_config.encoder_path
    again = base_index_load(snapshot_id="snap-1", config=default_config)
    assert again is not None and not again.built_here


@pytest.mark.parametrize(("change", "reason"), [
    (lambda meta: meta["encoder_runtime"].update(isa_class="amx-bf16", precision="int8+bf16"),
     "precision 'int8+bf16' there"),
    (lambda meta: meta["encoder_runtime"].update(isa_class="avx512-vnni-bf16"), "isa_class 'avx512-vnni-bf16' there"),
    (lambda meta: meta.pop("encoder_runtime", None), "records no encoder precision or CPU class"),
])
def test_an_index_made_another_way_is_rebuilt_saying_why(default_config, tiny_repository, caplog, change, reason):
    """An index built on another kind of CPU (or before the record existed), found in a shared index root or
    copied here, must not be searched with this machine's query vectors."""
    first = _build(default_config, tiny_repository)
    vectors = np.array(first.table.vectors)
    _rewrite_meta(default_config, change)
    with caplog.at_level(logging.WARNING, logger="sandboxes.semantic.index"):
        assert base_index_load(snapshot_id="snap-1", config=default_config) is None
        rebuilt = _build(default_config, tiny_repository)
    assert rebuilt.built_here
    assert any("will be rebuilt" in message and reason in message for message in _index_messages(caplog))
    meta = json.loads((rebuilt.directory / "meta.json").read_text())
    assert meta["encoder_runtime"]["isa_class"] == this_cpu()[0]
    np.testing.assert_allclose(np.array(rebuilt.table.vectors, dtype=np.float32), vectors.astype(np.float32), atol=1e-3)
    assert not [path.name for path in rebuilt.directory.parent.iterdir() if path.name.endswith((".replaced", ".tmp"))]
    assert base_index_load(snapshot_id="snap-1", config=default_config) is not None


def test_a_float32_index_from_before_the_record_is_kept(tmp_path, encoder_cache, tiny_repository, caplog):
    """The reference path's f32 vectors agree across x86 CPUs to rounding: no rebuild for a missing record or
    another ISA class, but one for another precision."""
    config = SemanticSearchConfig(index_root=tmp_path / "index", vector_store="memory", encoder_cache_dir=encoder_cache,
                                  encoder_backend="torch")
    _build(config, tiny_repository)
    _rewrite_meta(config, lambda meta: meta.pop("encoder_runtime", None))
    with caplog.at_level(logging.WARNING, logger="sandboxes.semantic.index"):
        assert base_index_load(snapshot_id="snap-1", config=config) is not None
        _rewrite_meta(config, lambda meta: meta.update(encoder_runtime={"backend": "torch", "precision": "f32",
                                                                         "isa_class": "amx-bf16"}))
        assert base_index_load(snapshot_id="snap-1", config=config) is not None
        assert not _index_messages(caplog)
        _rewrite_meta(config, lambda meta: meta.update(encoder_runtime={"backend": "torch", "precision": "bf16"}))
        assert base_index_load(snapshot_id="snap-1", config=config) is None
    assert "precision 'bf16' there, 'f32' here" in _index_messages(caplog)[-1]


def test_an_unreadable_record_is_rebuilt_not_trusted(default_config, tiny_repository, caplog):
    _build(default_config, tiny_repository)
    meta_path = base_index_directory(snapshot_id="snap-1", config=default_config) / "meta.json"
    meta_path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="sandboxes.semantic.index"):
        assert _build(default_config, tiny_repository).built_here
    assert "meta.json is unreadable" in _index_messages(caplog)[0]
