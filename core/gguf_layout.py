"""A GGUF file's layout read straight from its header, and cut copies written from it by byte ranges.

``gguf.GGUFReader`` builds a numpy view of every element of every metadata array: on a real model with a
262,144-token vocabulary that is eight seconds before anything is known, in every `up` and `plan`. This reads
what ggml-cluster needs (scalars, numeric arrays, the length of string arrays, the tensor table) in a fraction
of a second, and writes a model cut to its first layers by copying the source's own bytes, so that a cut of a
40 GB model costs the disk write of the tensors it keeps and nothing more.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import InventoryError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Entry:
    """One metadata key: its value (string arrays: their length only) and where its bytes lie in the file."""

    key: str
    kind: int
    value: object
    start: int
    end: int
    item_kind: int | None = None  # arrays: the type of their items


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: name, shape, ggml type, and where its data lies in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class GgufLayout:
    """A GGUF file's version, metadata, tensor table and data section, as offsets into the file."""

    path: Path
    version: int
    entries: dict[str, Entry]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    alignment: int

    def get(self, key: str, default: object = None) -> object:
        """A metadata value (string arrays: their length), or ``default``."""
        entry = self.entries.get(key)
        return default if entry is None else entry.value


class _Cursor:
    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.at, self.path = data, 0, path

    def take(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from("<" + fmt, self.data, self.at)
        except struct.error:
            raise InventoryError(f"model: {self.path} is not a readable GGUF file: it ends inside its header") from None
        self.at += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        raw = self.data[self.at:self.at + length]
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, *, keep_strings: bool = True) -> object:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])[0]
        if kind == _STRING:
            if keep_strings:
                return self.string()
            (length,) = self.take("Q")
            self.at += length
            return None
        if kind == _ARRAY:
            item_kind, count = self.take("IQ")
            if item_kind in _SCALARS:
                return list(self.take(f"{count}{_SCALARS[item_kind]}"))
            for _ in range(count):  # a vocabulary: walk it, keep only its length
                self.value(item_kind, keep_strings=False)
            return count
        raise InventoryError(f"model: {self.path} is not a readable GGUF file: unknown value type {kind}")


def read_layout(path: Path) -> GgufLayout:
    """The layout of the GGUF file at ``path``; InventoryError (one line) when it is missing or not GGUF."""
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data, path)
    except FileNotFoundError:
        raise InventoryError(f"model: no such file {path}", "fix: point 'model' at a .gguf file") from None
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise InventoryError(f"model: {path} is not a readable GGUF file: {exc}") from None


def entry_bytes(layout: GgufLayout, key: str) -> bytes | None:
    """The bytes of metadata entry ``key`` as the file holds them (its key, type and value), or None without it:
    two files' entries are equal when these are, without decoding a 262k-string vocabulary."""
    entry = layout.entries.get(key)
    if entry is None:
        return None
    with layout.path.open("rb") as handle:
        handle.seek(entry.start)
        return handle.read(entry.end - entry.start)


def string_items(layout: GgufLayout, key: str) -> list[str]:
    """The items of the string-array entry ``key`` (a vocabulary's tokens)."""
    entry = layout.entries[key]
    with layout.path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data, layout.path)
        cursor.at = entry.start
        cursor.string()
        kind, item_kind, count = cursor.take("IIQ")
        if kind != _ARRAY or item_kind != _STRING:
            raise InventoryError(f"model: {layout.path}: {key} is not an array of strings")
        return [cursor.string() for _ in range(count)]


def _parse(data: mmap.mmap, path: Path) -> GgufLayout:
    if data[:4] != MAGIC:
        raise InventoryError(f"model: {path} is not a readable GGUF file: it does not start with 'GGUF'")
    cursor = _Cursor(data, path)
    cursor.at = 4
    version, n_tensors, n_kv = cursor.take("IQQ")
    if version not in (2, 3):
        raise InventoryError(f"model: {path} is GGUF version {version}; only versions 2 and 3 (little-endian) are read")
    entries: dict[str, Entry] = {}
    for _ in range(n_kv):
        start = cursor.at
        key = cursor.string()
        (kind,) = cursor.take("I")
        item_kind = struct.unpack_from("<I", data, cursor.at)[0] if kind == _ARRAY else None
        value = cursor.value(kind)
        entries[key] = Entry(key, kind, value, start, cursor.at, item_kind)
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        (n_dims,) = cursor.take("I")
        dims = cursor.take(f"{n_dims}Q")
        ggml_type, offset = cursor.take("IQ")
        tensors.append(TensorInfo(name, dims, ggml_type, offset, tensor_bytes(dims, ggml_type, path)))
    alignment = int(str(entries["general.alignment"].value)) if "general.alignment" in entries else DEFAULT_ALIGNMENT
    return GgufLayout(path, version, entries, tuple(tensors), _aligned(cursor.at, alignment), alignment)


def tensor_bytes(dims: tuple[int, ...], ggml_type: int, path: Path) -> int:
    """Bytes of a tensor's data: elements over the type's block size, times the block's bytes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise InventoryError(f"model: {path} has a tensor of ggml type {ggml_type}, which this gguf package does not "
                             "know", "fix: upgrade the gguf package") from None
    elements = 1
    for dim in dims:
        elements *= dim
    return elements // block * block_bytes


def _aligned(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


def _encode_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_cut(layout: GgufLayout, layers: int, target: Path) -> None:
    """Write ``layout``'s model cut to its first ``layers`` blocks to ``target``: the metadata with the block count
    (and per-layer arrays) cut, the other tensors and every kept byte copied from the source as they are."""
    arch = str(layout.get("general.architecture", ""))
    block_key = f"{arch}.block_count"
    total = int(str(layout.get(block_key, 0)))
    kept = [tensor for tensor in layout.tensors
            if not tensor.name.startswith("blk.") or int(tensor.name.split(".")[1]) < layers]
    with layout.path.open("rb") as source, target.open("wb") as out:
        out.write(MAGIC + struct.pack("<IQQ", layout.version, len(kept), len(layout.entries)))
        for entry in layout.entries.values():
            if entry.key == block_key:
                out.write(_encode_string(entry.key) + struct.pack("<I" + _SCALARS[entry.kind], entry.kind, layers))
            elif (entry.kind == _ARRAY and entry.item_kind in _SCALARS and isinstance(entry.value, list)
                  and len(entry.value) == total):
                # Per-layer arrays (head counts, sliding-window patterns) keep their first ``layers`` items.
                assert entry.item_kind is not None
                items = entry.value[:layers]
                out.write(_encode_string(entry.key) + struct.pack("<IIQ", _ARRAY, entry.item_kind, len(items))
                          + struct.pack(f"<{len(items)}{_SCALARS[entry.item_kind]}", *items))
            else:
                source.seek(entry.start)
                out.write(source.read(entry.end - entry.start))
        offsets, at = [], 0
        for tensor in kept:
            offsets.append(at)
            at = _aligned(at + tensor.n_bytes, layout.alignment)
        for tensor, offset in zip(kept, offsets, strict=True):
            shape = struct.pack(f"<I{len(tensor.dims)}Q", len(tensor.dims), *tensor.dims)
            out.write(_encode_string(tensor.name) + shape + struct.pack("<IQ", tensor.ggml_type, offset))
        out.write(b"\0" * (-out.tell() % layout.alignment))
        data_start = out.tell()
        for tensor, offset in zip(kept, offsets, strict=True):
            out.write(b"\0" * (data_start + offset - out.tell()))
            source.seek(layout.data_start + tensor.offset)
            remaining = tensor.n_bytes
            while remaining:
                chunk = source.read(min(remaining, 16 << 20))
                if not chunk:
                    raise InventoryError(f"model: {layout.path} ends inside tensor {tensor.name}")
                out.write(chunk)
                remaining -= len(chunk)
