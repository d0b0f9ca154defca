"""GGUF model facts (via the `gguf` package) and the built-in demo model."""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import InventoryError

DEMO_MODEL_NAME = "ggml-cluster-demo-v3.gguf"  # v3: a chat template
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    """What the planner and the dashboard need to know about a model."""

    path: Path
    name: str
    architecture: str
    n_layers: int
    n_embd: int
    layer_bytes: tuple[int, ...]   # weights of each repeating block
    output_bytes: int              # output norm + output matrix (llama.cpp's "layer" n_layers)
    input_bytes: int               # token embeddings; stay on the coordinator's CPU
    kv_bytes_per_token_layer: int  # f16 K and V for one token in one layer

    def kv_bytes(self, context: int) -> int:
        """KV-cache bytes of one layer at a context size."""
        return self.kv_bytes_per_token_layer * context


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the GGUF header describes it."""

    name: str
    shape: tuple[int, ...]
    n_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's scalar metadata and its tensors' descriptions; arrays (the vocabulary) are passed over."""

    fields: dict[str, object]
    tensors: tuple[TensorInfo, ...]


# GGUF value types (gguf.GGUFValueType) whose values are one fixed-size number, as struct formats.
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_GGUF_MAGIC = b"GGUF"


class _Cursor:
    """Reads a GGUF header front to back, in the file's byte order."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offset = 0
        self.order = "<"

    def number(self, kind: str) -> Any:
        value = struct.unpack_from(self.order + kind, self.data, self.offset)[0]
        self.offset += struct.calcsize(kind)
        return value

    def text(self) -> str:
        size = self.number("Q")
        raw = self.data[self.offset:self.offset + size]
        if len(raw) != size:
            raise ValueError("the header is cut short")
        self.offset += size
        return raw.decode("utf-8")

    def value(self, kind: int) -> object:
        """The value of a field of type ``kind``; None for an array, which is skipped, not read."""
        if kind == _STRING:
            return self.text()
        if kind != _ARRAY:
            return self.number(_NUMBERS[kind])
        item, count = self.number("I"), self.number("Q")
        if item in _NUMBERS:
            self.offset += count * struct.calcsize(_NUMBERS[item])
        else:  # strings (each says its length) and nested arrays: one at a time
            for _ in range(count):
                self.value(item)
        return None


def read_header(path: Path) -> GgufHeader:
    """The metadata and tensor list of a GGUF file (versions 2 and 3, either byte order).

    gguf's GGUFReader builds an object for every element of every array: for a 262,144-token vocabulary that
    takes ~10 s, and `up`, `plan` and the controller each read the model. The header is all they need.
    Raises ValueError for a file that is not a GGUF, or is cut short.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as handle:
        if os.fstat(handle.fileno()).st_size < 24:
            raise ValueError("too short for a GGUF header")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            try:
                if data[:4] != _GGUF_MAGIC:
                    raise ValueError("no GGUF magic at its start")
                cursor.offset = 4
                version = cursor.number("I")
                if version & 0xFFFF == 0:  # written on a machine of the other byte order
                    cursor.order = ">"
                    version = int.from_bytes(data[4:8], "big")
                if version not in (2, 3):
                    raise ValueError(f"GGUF version {version} (2 and 3 are read)")
                n_tensors, n_fields = cursor.number("Q"), cursor.number("Q")
                fields = {}
                for _ in range(n_fields):
                    key = cursor.text()
                    fields[key] = cursor.value(cursor.number("I"))
                tensors = []
                for _ in range(n_tensors):
                    name = cursor.text()
                    shape = tuple(cursor.number("Q") for _ in range(cursor.number("I")))
                    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(cursor.number("I"))]
                    cursor.number("Q")  # the data's offset
                    tensors.append(TensorInfo(name, shape, math.prod(shape) * size // block))
            except (struct.error, KeyError) as exc:
                raise ValueError(f"the header is cut short or has an unknown type ({exc})") from None
    return GgufHeader(fields, tuple(tensors))


def read_model(path: Path) -> ModelFacts:
    """Read layer count and per-layer sizes from a GGUF file."""
    try:
        header = read_header(path)
    except FileNotFoundError:
        raise InventoryError(f"model: no such file {path}", "fix: point 'model' at a .gguf file") from None
    except (ValueError, OSError) as exc:
        raise InventoryError(f"model: {path} is not a readable GGUF file: {exc}") from None

    def field(key: str, default: object = None) -> object:
        return header.fields.get(key, default)

    arch = str(field("general.architecture", "unknown"))
    n_layers = int(str(field(f"{arch}.block_count", 0)))
    n_embd = int(str(field(f"{arch}.embedding_length", 0)))
    n_head = int(str(field(f"{arch}.attention.head_count", 1)))
    n_head_kv = int(str(field(f"{arch}.attention.head_count_kv", n_head)))
    head_k = int(str(field(f"{arch}.attention.key_length", n_embd // max(n_head, 1))))
    head_v = int(str(field(f"{arch}.attention.value_length", head_k)))
    layer_bytes = [0] * n_layers
    output_bytes = input_bytes = 0
    for tensor in header.tensors:
        match = _BLOCK.match(tensor.name)
        if match and int(match.group(1)) < n_layers:
            layer_bytes[int(match.group(1))] += int(tensor.n_bytes)
        elif tensor.name.startswith("token_embd"):
            input_bytes += int(tensor.n_bytes)
        else:
            output_bytes += int(tensor.n_bytes)
    if n_layers <= 0:
        raise InventoryError(f"model: {path} declares no layers ({arch}.block_count)")
    return ModelFacts(
        path=path,
        name=path.name,
        architecture=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        layer_bytes=tuple(layer_bytes),
        output_bytes=output_bytes,
        input_bytes=input_bytes,
        kv_bytes_per_token_layer=2 * (head_k + head_v) * n_head_kv,
    )


# Words for the demo vocabulary; every token string is unique (llama.cpp asserts on duplicates).
_WORDS = (
    "the of and to in is that it for on with as was at by be this from or have an not are but all "
    "they we can one their there which so what up out if about who get go me when make like time no "
    "just him know take people into year your good some could them see other than then now look only "
    "come its over think also back after use two how our work first well way even new want because any "
    "these give day most us node cluster model layer token worker shard graph compute memory tensor fast "
    "slow ready split plan route send load run wait stream text byte bit light river stone cloud tree "
    "mountain ocean north south east west red blue green gold silver quiet loud small large old young"
).split()


# Plain text (no special tokens the demo vocabulary lacks): "role: content" lines, then "assistant:".
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _demo_vocab() -> tuple[list[str], list[float], list[int], list[bool]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # unknown, control, control
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [6] * 256  # byte fallback
    pieces: dict[str, None] = {}
    for char in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()":
        pieces[char] = None
    for word in _WORDS:
        spelled = "▁" + word
        # Every prefix is a token so SentencePiece-style merges can reach the whole word.
        for end in range(2, len(spelled) + 1):
            pieces[spelled[:end]] = None
    tokens += list(pieces)
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [float(len(piece)) - index * 1e-4 for index, piece in enumerate(pieces)]
    whole = {"▁" + word for word in _WORDS}
    words = [token in whole for token in tokens]
    return tokens, scores, types, words


def write_demo_model(path: Path, *, n_layers: int = 8, n_embd: int = 128, n_ff: int = 352,
                     n_head: int = 4, n_head_kv: int = 2, seed: int = 1234) -> Path:
    """Write a small llama-architecture GGUF with seeded random f16 weights (a few MB), atomically."""
    import gguf

    tokens, scores, types, words = _demo_vocab()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        values: np.ndarray = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)
        return values

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name("ggml-cluster demo (random weights)")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(DEMO_CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", (rng.standard_normal((n_vocab, n_embd))).astype(np.float16))
    for layer in range(n_layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", norm())
        writer.add_tensor(prefix + "attn_q.weight", matrix(n_embd, n_embd))
        writer.add_tensor(prefix + "attn_k.weight", matrix(head_dim * n_head_kv, n_embd))
        writer.add_tensor(prefix + "attn_v.weight", matrix(head_dim * n_head_kv, n_embd))
        writer.add_tensor(prefix + "attn_output.weight", matrix(n_embd, n_embd))
        writer.add_tensor(prefix + "ffn_norm.weight", norm())
        writer.add_tensor(prefix + "ffn_gate.weight", matrix(n_ff, n_embd))
        writer.add_tensor(prefix + "ffn_up.weight", matrix(n_ff, n_embd))
        writer.add_tensor(prefix + "ffn_down.weight", matrix(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", norm())
    # Only whole words get output weights: other tokens score exactly 0 and lose the argmax, so the
    # demo's greedy text is (random) words rather than stray bytes that are not valid UTF-8.
    output = matrix(n_vocab, n_embd) * np.float16(4.0)
    output[~np.asarray(words)] = 0
    writer.add_tensor("output.weight", output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def demo_model(cache_dir: Path) -> Path:
    """The demo model's path, writing it on first use."""
    path = cache_dir / "models" / DEMO_MODEL_NAME
    if not path.is_file():
        write_demo_model(path)
    return path
