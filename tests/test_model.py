"""GGUF facts and the demo model."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import InventoryError
from core.model import demo_model, read_header, read_model, write_demo_model


def test_demo_model_facts(tmp_path: Path) -> None:
    facts = read_model(write_demo_model(tmp_path / "demo.gguf"))
    assert facts.architecture == "llama"
    assert facts.n_layers == 8
    assert len(set(facts.layer_bytes)) == 1 and facts.layer_bytes[0] > 0
    assert facts.output_bytes > 0 and facts.input_bytes > 0
    # f16 K and V: 2 heads of 32 values each, 2 bytes a value.
    assert facts.kv_bytes(512) == 512 * 2 * (32 + 32) * 2
    assert (tmp_path / "demo.gguf").stat().st_size < 8 << 20


def test_demo_model_is_deterministic(tmp_path: Path) -> None:
    first = write_demo_model(tmp_path / "a.gguf").read_bytes()
    assert write_demo_model(tmp_path / "b.gguf").read_bytes() == first


def test_demo_model_is_written_once(tmp_path: Path) -> None:
    path = demo_model(tmp_path)
    stamp = path.stat().st_mtime_ns
    assert demo_model(tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert not list(path.parent.glob("*.partial"))


def test_demo_vocabulary_has_unique_tokens(tmp_path: Path) -> None:
    from gguf import GGUFReader

    tokens = GGUFReader(write_demo_model(tmp_path / "demo.gguf")).get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == len(set(tokens))


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(InventoryError, match="not a readable GGUF"):
        read_model(path)
    with pytest.raises(InventoryError, match="no such file"):
        read_model(tmp_path / "missing.gguf")


def test_the_header_reader_agrees_with_gguf_and_passes_over_arrays(tmp_path: Path) -> None:
    from gguf import GGUFReader, GGUFValueType

    path = write_demo_model(tmp_path / "demo.gguf")
    header, reader = read_header(path), GGUFReader(path)
    arrays = {name for name, field in reader.fields.items() if field.types[0] == GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in arrays
    assert header.fields == {name: None if name in arrays else field.contents()
                             for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert [(tensor.name, tensor.shape, tensor.n_bytes) for tensor in header.tensors] == [
        (tensor.name, tuple(int(size) for size in tensor.shape), int(tensor.n_bytes)) for tensor in reader.tensors]


def test_a_gguf_cut_short_is_not_readable(tmp_path: Path) -> None:
    whole = write_demo_model(tmp_path / "demo.gguf").read_bytes()
    for size in (3, 30, 4000):  # in the magic, the counts, the vocabulary
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(whole[:size])
        with pytest.raises(InventoryError, match="not a readable GGUF"):
            read_model(path)
