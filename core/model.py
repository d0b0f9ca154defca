"""GGUF model facts (via the `gguf` package) and the built-in demo model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import InventoryError
from core.gguf_layout import GgufLayout, entry_bytes, read_layout, string_items

DEMO_MODEL_NAME = "ggml-cluster-demo-v3.gguf"  # v3: a chat template
_BLOCK = re.compile(r"^blk\.(\d+)\.")


# llama-cpp-python's default n_batch and n_ubatch, which the coordinator keeps: llama.cpp sizes its compute
# buffers for a micro-batch of min(context, BATCH) tokens.
BATCH = 512
# Outputs (rows of logits) llama.cpp reserves room for per slot: the coordinator asks for two per sequence
# (n_outputs_max = 2 x slots; core.engine.coordinator), not llama.cpp's default of the whole micro-batch.
OUTPUTS_PER_SLOT = 2
# Rows a decode step may hold for each row's logits to be those of its token decoded alone: the CPU workers'
# kernels take another path from five rows on (measured on Gemma 3 270M: 0 difference up to four rows, 0.4-1.0 in
# a logit from five), which can change a greedy choice at a near-tie. Drafts only fill rows up to this many.
INVARIANT_ROWS = 4
# Drafted tokens a slot verifies in one step at most (speculative decoding, core.engine.speculation); each is one
# more output, whose logits (or sampler) the last device makes room for.
DRAFT_MAX = INVARIANT_ROWS - 1


def outputs_per_slot(speculative: bool) -> int:
    """The outputs llama.cpp makes room for per slot: one token and its drafts when speculating."""
    return 1 + DRAFT_MAX if speculative else OUTPUTS_PER_SLOT


@dataclass(frozen=True)
class ModelFacts:
    """What the planner and the dashboard need to know about a model, as llama.cpp lays it out on devices.

    The output layer (``output_norm`` and ``output.weight``, or, when a model has no ``output.weight``, its tied
    ``token_embd.weight``, which llama.cpp duplicates) goes to the device that holds the last layer; that
    device also sends the logits (``n_vocab`` floats) to the coordinator every token. The input embeddings stay
    on the coordinator's CPU.
    """

    path: Path
    name: str
    architecture: str
    n_layers: int
    n_embd: int
    layer_bytes: tuple[int, ...]   # weights of each repeating block, at their own types
    output_bytes: int              # output norm + output matrix (llama.cpp's "layer" n_layers)
    input_bytes: int               # token embeddings; stay on the coordinator's CPU
    kv_bytes_per_token_layer: int  # f16 K and V of one token in one layer (the largest layer's)
    n_vocab: int = 0
    n_ff: int = 0
    tied_output: bool = False      # the output matrix is the token embeddings (no output.weight)
    sliding_window: int = 0        # tokens, for architectures with sliding-window layers
    kv_layer_token_bytes: tuple[int, ...] = ()  # per layer, where the architecture varies its KV heads
    outputs_per_slot: int = OUTPUTS_PER_SLOT  # as the coordinator loads it (outputs_per_slot())

    def kv_bytes(self, context: int) -> int:
        """KV-cache bytes of the largest layer at a context size."""
        return self.kv_bytes_per_token_layer * context

    def layer_kv_bytes(self, layer: int, context: int) -> int:
        """KV-cache bytes of one layer at a context size.

        Sliding-window layers hold the whole context too: the coordinator keeps llama.cpp's full-size SWA
        cache, which lets a request's tokens be rolled back and replayed from any position.
        """
        per_token = self.kv_layer_token_bytes[layer] if self.kv_layer_token_bytes else self.kv_bytes_per_token_layer
        return per_token * context

    @property
    def logits_bytes(self) -> int:
        """What the last device sends the coordinator per token: one f32 logit per vocabulary entry."""
        return self.n_vocab * 4

    def compute_bytes(self, context: int, *, last: bool, batch: int = BATCH, slots: int = 1) -> int:
        """The compute buffer llama.cpp reserves on a device that holds layers, for its largest micro-batch
        (``batch`` tokens, at most the context), with ``slots`` sequences.

        Activations: 4·n_ff + 4.3·n_embd floats per token of the micro-batch, and 8 bytes per (token, KV cell) of
        attention masks, one per KV cache (two with sliding-window layers); calibrated against llama.cpp's
        reported reserve on llama and gemma3 models (within 2%). The last device also holds the logits of the
        outputs llama.cpp makes room for (``outputs_per_slot`` per slot; llama.cpp's default, every token of the
        micro-batch, would be 512 MiB for a 262,144-token vocabulary).
        """
        batch = min(context, batch)
        caches = 2 if self.sliding_window else 1
        size = int(batch * 4 * (4 * self.n_ff + 4.3 * self.n_embd)) + batch * 8 * context * caches
        return size + (self.logits_buffer_bytes(context, batch, slots) if last else 0)

    def logits_buffer_bytes(self, context: int, batch: int = BATCH, slots: int = 1) -> int:
        """The logits of the outputs of a micro-batch, which llama.cpp reserves on the last device."""
        return min(context, batch, self.outputs_per_slot * slots) * self.logits_bytes


def read_model(path: Path, *, speculative: bool = False) -> ModelFacts:
    """Read layer count, per-layer sizes and the architecture's attention shape from a GGUF file; ``speculative``:
    the coordinator will load it to verify drafts (more outputs per slot)."""
    layout = read_layout(path)
    field = layout.get

    def number(key: str, default: int) -> int:
        value = field(key, default)
        return int(max(value) if isinstance(value, list) and value else str(value))  # per-layer arrays: the largest

    arch = str(field("general.architecture", "unknown"))
    n_layers = number(f"{arch}.block_count", 0)
    n_embd = number(f"{arch}.embedding_length", 0)
    n_head = number(f"{arch}.attention.head_count", 1)
    head_k = number(f"{arch}.attention.key_length", n_embd // max(n_head, 1))
    head_v = number(f"{arch}.attention.value_length", head_k)
    kv_heads = field(f"{arch}.attention.head_count_kv", n_head)
    per_layer_heads = [int(heads) for heads in kv_heads] if isinstance(kv_heads, list) else []
    layer_bytes = [0] * n_layers
    output_bytes = input_bytes = 0
    names = set()
    for tensor in layout.tensors:
        names.add(tensor.name)
        match = _BLOCK.match(tensor.name)
        if match and int(match.group(1)) < n_layers:
            layer_bytes[int(match.group(1))] += tensor.n_bytes
        elif tensor.name.startswith("token_embd"):
            input_bytes += tensor.n_bytes
        else:
            output_bytes += tensor.n_bytes
    tied = "output.weight" not in names and "token_embd.weight" in names
    if tied:
        output_bytes += next(tensor.n_bytes for tensor in layout.tensors if tensor.name == "token_embd.weight")
    if n_layers <= 0:
        raise InventoryError(f"model: {path} declares no layers ({arch}.block_count)")
    per_token = [2 * (head_k + head_v) * heads for heads in per_layer_heads[:n_layers]]
    return ModelFacts(
        outputs_per_slot=outputs_per_slot(speculative),
        path=path,
        name=path.name,
        architecture=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        layer_bytes=tuple(layer_bytes),
        output_bytes=output_bytes,
        input_bytes=input_bytes,
        kv_bytes_per_token_layer=max(per_token) if per_token else 2 * (head_k + head_v) * int(str(kv_heads)),
        n_vocab=number("tokenizer.ggml.tokens", 0) or number(f"{arch}.vocab_size", 0),
        n_ff=number(f"{arch}.feed_forward_length", 0),
        tied_output=tied,
        sliding_window=number(f"{arch}.attention.sliding_window", 0),
        kv_layer_token_bytes=tuple(per_token) if len(set(per_token)) > 1 else (),
    )


TOKENS_KEY = "tokenizer.ggml.tokens"


def check_draft_model(draft: Path, model: Path, source: str) -> None:
    """InventoryError (one line, naming the inventory ``source`` and its field) unless ``draft`` is a whole GGUF
    model with ``model``'s vocabulary: the same tokens at the same ids, which drafts verified by ``model`` need."""
    field = f"{source}: speculative.draft_model"
    if not draft.is_file():
        raise InventoryError(f"{field}: no such file {draft}", "fix: point it at a GGUF file on this machine")
    try:
        drafting = read_layout(draft)
    except InventoryError as exc:
        raise InventoryError(f"{field}: {exc.message.removeprefix('model: ')}",
                             "fix: point it at a GGUF file (llama.cpp's model format)") from None
    target = read_layout(model)
    tokens = entry_bytes(drafting, TOKENS_KEY)
    if tokens is None or tokens != entry_bytes(target, TOKENS_KEY):  # equal bytes: equal vocabularies, at once
        _compare_vocabularies(drafting, target, field)
    arch = str(drafting.get("general.architecture", ""))
    if not drafting.tensors or int(str(drafting.get(f"{arch}.block_count", 0))) <= 0:
        raise InventoryError(f"{field}: {draft.name} holds no model, only metadata (no layers)",
                             "fix: point it at a model's GGUF file")
    end = drafting.data_start + max(tensor.offset + tensor.n_bytes for tensor in drafting.tensors)
    size = draft.stat().st_size
    if size < end:
        raise InventoryError(f"{field}: {draft.name} is cut short: {size} of its {end} bytes",
                             "fix: download or copy it again")


def _compare_vocabularies(drafting: GgufLayout, target: GgufLayout, field: str) -> None:
    """InventoryError unless the two files hold the same tokens (written differently)."""
    draft, model = drafting.path, target.path
    same_family = ("fix: point speculative.draft_model at a smaller model of the same family (the same tokenizer), "
                   "or set speculative: ngram")
    theirs, ours = drafting.get(TOKENS_KEY), target.get(TOKENS_KEY)
    if not isinstance(theirs, int):
        raise InventoryError(f"{field}: {draft} has no vocabulary ({TOKENS_KEY})", same_family)
    if not isinstance(ours, int):
        raise InventoryError(f"{field}: the model {model} has no vocabulary ({TOKENS_KEY}) to draft in", same_family)
    if theirs != ours:
        raise InventoryError(f"{field}: {draft.name} has a vocabulary of {theirs} tokens, the model {model.name} "
                             f"{ours}: drafts must be the model's own tokens", same_family)
    mine, its = string_items(drafting, TOKENS_KEY), string_items(target, TOKENS_KEY)
    first = next((index for index, (one, other) in enumerate(zip(mine, its, strict=True)) if one != other), None)
    if first is not None:  # else the same tokens, written differently
        raise InventoryError(f"{field}: {draft.name} and the model {model.name} have different vocabularies (token "
                             f"{first} is {mine[first]!r} in one, {its[first]!r} in the other)", same_family)


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
