"""GGUF facts and the demo model."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import InventoryError
from core.model import demo_model, read_model, write_demo_model

MIB = 1 << 20


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


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\x01" * 20,
                                     b"GGUF\x09\x00\x00\x00" + b"\0" * 16])
def test_broken_headers_are_one_line_errors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(InventoryError, match=r"^model: .*x\.gguf (is not a readable GGUF file|is GGUF version 9)"):
        read_model(path)


def test_the_header_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    from gguf import GGUFReader

    from core.gguf_layout import read_layout

    path = write_demo_model(tmp_path / "demo.gguf")
    layout, reader = read_layout(path), GGUFReader(path)
    assert [(t.name, t.n_bytes, layout.data_start + t.offset) for t in layout.tensors] == [
        (t.name, int(t.n_bytes), int(t.data_offset)) for t in reader.tensors]
    assert layout.get("tokenizer.ggml.tokens") == len(reader.get_field("tokenizer.ggml.tokens").contents())
    assert layout.get("llama.block_count") == 8 and layout.get("general.architecture") == "llama"


# What llama.cpp (0.3.36) reported allocating on two RPC workers, split 10/8 layers, flash attention on:
# model buffers, and compute buffers at three contexts (MiB), one slot. The model facts must predict them. With
# llama.cpp's default room for 512 outputs the last device's were 526.33, 550.33 and 582.33 MiB: the coordinator
# asks for two per slot (core.model.OUTPUTS_PER_SLOT), and their 2 MiB of logits fit in memory llama.cpp reuses.
GEMMA_REPORTED = {"model": (35.82, 199.34), "kv_4096_per_layer": 4.0,
                  "compute": {1024: (29.57, 29.57), 4096: (53.57, 53.57), 8192: (85.57, 85.57)}}


def test_real_model_facts_match_what_llama_cpp_allocates() -> None:
    from core.planner import device_bytes
    from tests.realmodel import real_model

    facts = read_model(real_model())
    assert (facts.architecture, facts.n_layers, facts.n_vocab, facts.sliding_window) == ("gemma3", 18, 262144, 512)
    # No output.weight: the tied Q8_0 token embeddings are the output layer too, on the last device.
    assert facts.tied_output and facts.output_bytes == facts.input_bytes + 640 * 4
    weights = (sum(facts.layer_bytes[:10]), sum(facts.layer_bytes[10:]) + facts.output_bytes)
    assert [round(size / MIB, 2) for size in weights] == list(GEMMA_REPORTED["model"])
    assert facts.layer_kv_bytes(0, 4096) == GEMMA_REPORTED["kv_4096_per_layer"] * MIB
    for context, (first, last) in GEMMA_REPORTED["compute"].items():
        assert facts.compute_bytes(context, last=False) / MIB == pytest.approx(first, rel=0.02)
        # Conservative on the last device, by at most the logits' rows: llama.cpp fits them in memory it reuses.
        over = facts.compute_bytes(context, last=True) / MIB - last
        assert 0 <= over <= facts.logits_buffer_bytes(context) / MIB + 0.02 * last
    assert device_bytes(facts, (10, 17), 4096, output=True) == (
        sum(facts.layer_bytes[10:]) + facts.output_bytes + 8 * 4 * MIB + facts.compute_bytes(4096, last=True))


def test_synthetic_compute_buffers_match_llama_cpp(tmp_path: Path) -> None:
    facts = read_model(write_demo_model(tmp_path / "demo.gguf"))
    # llama.cpp's reports for the demo model: 7.85 MiB at 1024 cells, 19.85 MiB at 4096.
    assert facts.compute_bytes(1024, last=False) / MIB == pytest.approx(7.85, rel=0.02)
    assert facts.compute_bytes(4096, last=False) / MIB == pytest.approx(19.85, rel=0.02)
    assert not facts.tied_output and facts.n_vocab == 689


def test_a_gguf_cut_short_is_not_readable(tmp_path: Path) -> None:
    whole = write_demo_model(tmp_path / "demo.gguf").read_bytes()
    for size in (3, 30, 4000):  # in the magic, the counts, the vocabulary
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(whole[:size])
        with pytest.raises(InventoryError, match="not a readable GGUF"):
            read_model(path)
