"""The coordinator: a child process that runs llama-cpp-python with the workers as RPC devices.

It is a separate process on purpose: llama.cpp's RPC client calls abort() when a worker goes away,
and only this process dies with it. It speaks core.engine.protocol on stdin and stdout: `Ready` or `Failed`
once loaded, then per `Generate` its prompt tokens, progress while the prompt (and a replay) is evaluated, a
token at a time, and `Done`. `Cancel` reaches only the request it names, and only while that request is
queued or running: a cancel for a request already done can never reach a later one. ``messages`` (OpenAI chat
messages) are rendered with the inventory's chat_template (a llama-cpp-python chat format, or a Jinja file), else
with the GGUF's own template. Requests run in ``parallel`` slots, decoded together (core.engine.slots).

A `Generate` with ``replay`` holds tokens generated before a restart: the prompt is evaluated in the same
batches as the first time and each replayed token one at a time, exactly as first decoded, so with one slot the
KV cache and the output are bit-identical. Progress lines let the controller tell a long prompt from a hung worker.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from core.engine.chain import NodeSampler, coordinator_reason
from core.engine.draft_model import DraftModel
from core.engine.llama_context import LlamaEngine
from core.engine.protocol import (
    EXIT_COMPUTE_FAILED,
    Answer,
    Cancel,
    Failed,
    Generate,
    Ready,
    Request,
    Shutdown,
    TokenLogprobs,
    TopLogprob,
    decode_request,
    encode,
)
from core.engine.rpc_client import ComputeStatus, register_rpc_servers
from core.engine.sampling import GrammarError, Logprobs, sampler_for
from core.engine.slots import Choose, PersistentComputeFailure, RequestIds, Scheduler, Slot
from core.engine.speculation import NgramDraft
from core.engine.step import Draft
from core.inventory_fields import DRAFT_P_MIN
from core.model import DRAFT_MAX, outputs_per_slot

# llama.cpp's default is `auto`, which turns flash attention on wherever the layer's device runs it; the RPC
# client answers "supported" for every op, so on a cluster auto means on (llama-bench, llama-server and
# llama-cli all run that way). llama-cpp-python can only say on or off, and its default, off, builds a graph
# of ~3 more ops per layer per token: measurably slower on small models.
FLASH_ATTENTION = True


@dataclass(frozen=True)
class CoordinatorConfig:
    """What the coordinator loads and where its workers are."""

    model: str
    endpoints: tuple[str, ...]
    tensor_split: tuple[float, ...]
    context: int                           # tokens each request may hold, prompt included
    threads: int = 1
    chat_format: str | None = None         # a llama-cpp-python chat format by name, instead of the GGUF's template
    chat_template_file: str | None = None  # a Jinja chat template file, instead of the GGUF's template
    parallel: int = 1                      # slots: requests decoded together, each with its own `context`
    sampling: str = "node"                 # node: where the output layer is (core.engine.chain); coordinator: here
    speculative: str = "ngram"             # ngram: drafts verified in the step (core.engine.speculation); off;
    #                                        draft_model: drafts from ``draft_model`` (core.engine.draft_model)
    draft_model: str | None = None         # a GGUF with the model's vocabulary, run here on the CPU
    draft_threads: int = 1                 # the draft model's CPU threads
    draft_p_min: float = DRAFT_P_MIN       # a draft ends at a token the draft model gives less than this probability

    @property
    def speculates(self) -> bool:
        """Whether drafted tokens are verified (core.engine.speculation)."""
        return self.speculative != "off"

    def to_json(self) -> str:
        """Serialise for the child's command line."""
        return json.dumps({"model": self.model, "endpoints": list(self.endpoints),
                           "tensor_split": list(self.tensor_split), "context": self.context,
                           "threads": self.threads, "chat_format": self.chat_format,
                           "chat_template_file": self.chat_template_file, "parallel": self.parallel,
                           "sampling": self.sampling, "speculative": self.speculative,
                           "draft_model": self.draft_model, "draft_threads": self.draft_threads,
                           "draft_p_min": self.draft_p_min})

    @classmethod
    def from_json(cls, text: str) -> CoordinatorConfig:
        """Parse what ``to_json`` wrote."""
        data = json.loads(text)
        return cls(model=data["model"], endpoints=tuple(data["endpoints"]),
                   tensor_split=tuple(data["tensor_split"]), context=int(data["context"]),
                   threads=int(data.get("threads", 1)), chat_format=data.get("chat_format"),
                   chat_template_file=data.get("chat_template_file"), parallel=int(data.get("parallel", 1)),
                   sampling=data.get("sampling", "node"), speculative=data.get("speculative", "ngram"),
                   draft_model=data.get("draft_model"), draft_threads=int(data.get("draft_threads", 1)),
                   draft_p_min=float(data.get("draft_p_min", DRAFT_P_MIN)))


NO_CHAT_TEMPLATE = ("the model has no chat template (no tokenizer.chat_template in its GGUF, and no chat_template in "
                    "the inventory); set chat_template to a chat format such as chatml or gemma, or to a Jinja "
                    "file, or send a plain prompt (/v1/completions) instead")


@dataclass(frozen=True)
class Chat:
    """How chat messages become prompt text: a llama-cpp-python chat formatter, and the BOS token's text."""

    formatter: Any  # llama_cpp.llama_chat_format.ChatFormatter: messages= → a response with .prompt
    bos: str

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for ``messages``."""
        return str(self.formatter(messages=messages).prompt)


def chat_format(name: str) -> Any:
    """llama-cpp-python's built-in chat format ``name`` (one of core.inventory.CHAT_FORMATS) as a formatter.

    llama-cpp-python registers a format only as a completion handler, which generates by itself; the coordinator
    needs the prompt alone, so it takes the formatter that the handler closes over.
    """
    from llama_cpp import llama_chat_format

    handler: Any = llama_chat_format.get_chat_completion_handler(name)
    closed_over = inspect.getclosurevars(handler).nonlocals
    if "chat_formatter" not in closed_over:
        raise ValueError(f"chat_template: llama-cpp-python's {name!r} is a chat handler, not a prompt format")
    return closed_over["chat_formatter"]


def load_chat(llm: Any, config: CoordinatorConfig) -> Chat | None:
    """The chat formatter for a loaded model: the inventory's chat format or template file, else the GGUF's
    tokenizer.chat_template, else None (chats are refused)."""
    model = llm._model  # the token texts a template writes, as llama-cpp-python's own handler takes them
    bos, eos = llm.token_bos(), llm.token_eos()
    bos_text = model.token_get_text(bos) if bos != -1 else ""
    if config.chat_format:
        return Chat(chat_format(config.chat_format), bos_text)
    if config.chat_template_file:
        template = Path(config.chat_template_file).read_text(encoding="utf-8")
    else:
        template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None
    import jinja2
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        formatter = Jinja2ChatFormatter(template, model.token_get_text(eos) if eos != -1 else "", bos_text)
    except jinja2.TemplateError as exc:
        where = config.chat_template_file or "the GGUF's tokenizer.chat_template"
        raise ValueError(f"the chat template ({where}) does not compile: {exc}") from None
    return Chat(formatter, bos_text)


@contextlib.contextmanager
def _sequences(parallel: int, outputs: int) -> Iterator[None]:
    """Make the next `Llama` hold ``parallel`` sequences, each in its own KV stream (n_ctx / parallel cells), and
    room for ``outputs`` outputs of each in a step.

    llama-cpp-python's Llama has no n_seq_max argument: its constructor starts from
    llama_context_default_params(), so for its duration that returns defaults with the slots' sequences.
    Separate streams (not unified): each slot attends over its own cells only and is sure of its whole context; a
    prefix two prompts share is copied from one stream to the other (core.engine.llama_context.LlamaEngine.copy).
    """
    from llama_cpp import llama_cpp as low

    original = low.llama_context_default_params

    def defaults() -> Any:
        params = original()
        params.n_seq_max = parallel
        params.kv_unified = False
        # Above 1, a sampler on the node draws from a copy of its generator and commits a draw only when the token
        # is accepted (llama.cpp's transactional dist): an output nobody takes (a draft the model rejected, a step
        # retried after a failed compute, the prompt's last token before a replay) then leaves the request's draws
        # as they were, and the i-th output of a step takes the i-th draw from there.
        params.n_outputs_max_per_seq = outputs
        params.n_outputs_max = outputs * parallel
        return params

    low.llama_context_default_params = defaults
    try:
        yield
    finally:
        low.llama_context_default_params = original


class Generator:
    """A loaded model: turns requests into slots for the scheduler (core.engine.slots)."""

    def __init__(self, llm: Any, lib: Any, chat: Chat | None = None, compute: ComputeStatus | None = None,
                 context: int | None = None, *, on_node: bool = False, speculative: bool = False,
                 draft_model: DraftModel | None = None) -> None:
        """``llm``: a `llama_cpp.Llama`; ``lib``: the llama_cpp module (its C calls); ``chat``: how chats become
        prompts, or None (chats are refused); ``compute``: the workers' reported compute failures; ``context``:
        tokens each request may hold (default: the whole context); ``on_node``: sample where the output layer is,
        each request that can be (core.engine.chain); ``speculative``: draft tokens from each request's own, for
        the step to verify (core.engine.speculation); ``draft_model``: draft with this model instead
        (core.engine.draft_model)."""
        self.requests = RequestIds()
        self.llm = llm
        self.lib = lib
        self.chat = chat
        self.compute = compute
        self.context = context or int(llm.n_ctx())
        self.vocab = lib.llama_model_get_vocab(llm.model)
        self.n_vocab = llm.n_vocab()
        self._ends: np.ndarray | None = None  # the end-of-text tokens, found when a request first ignores them
        self.on_node = on_node
        self.speculative = speculative
        self.draft_model = draft_model

    @classmethod
    def load(cls, config: CoordinatorConfig, compute: ComputeStatus | None = None) -> Generator:
        """Load the model across the registered RPC devices, with a KV sequence of ``context`` cells per slot."""
        import llama_cpp

        with _sequences(config.parallel, outputs_per_slot(config.speculates)):
            llm = llama_cpp.Llama(
                model_path=config.model, n_gpu_layers=-1, tensor_split=list(config.tensor_split) or None,
                n_ctx=config.context * config.parallel, n_threads=config.threads, n_threads_batch=config.threads,
                flash_attn=FLASH_ATTENTION, logits_all=False, verbose=True)
        draft_model = (DraftModel.load(config.draft_model, config.context, config.parallel, config.draft_threads,
                                       config.draft_p_min) if config.speculates and config.draft_model else None)
        return cls(llm, llama_cpp, load_chat(llm, config), compute, config.context,
                   on_node=config.sampling == "node", speculative=config.speculates, draft_model=draft_model)

    def prompt_tokens(self, request: Generate) -> list[int]:
        """The request's prompt as tokens: given, a chat rendered with the model's template, or plain text."""
        if request.prompt_tokens:
            return list(request.prompt_tokens)
        if request.messages is not None:
            if self.chat is None:
                raise ValueError(NO_CHAT_TEMPLATE)
            text, bos = self.chat.render(request.messages), self.chat.bos
            # A template that writes the BOS text itself must not get a second one from the tokenizer.
            return list(self.llm.tokenize(text.encode(), add_bos=not (bos and text.startswith(bos)), special=True))
        return list(self.llm.tokenize((request.prompt or "").encode(), add_bos=True, special=False))

    def prepare(self, request: Generate) -> Slot | Failed:
        """A request as a slot to schedule, or why it cannot run."""
        rid = request.id
        try:
            prompt = self.prompt_tokens(request)
        except (ValueError, TypeError, KeyError) as exc:  # jinja2's errors are ValueError/TypeError subclasses
            return Failed(f"cannot render the chat: {exc}", rid)
        if not prompt:
            return Failed("the prompt is empty", rid)
        if len(prompt) >= self.context:
            return Failed(f"the prompt has {len(prompt)} tokens; the context holds {self.context}", rid)
        try:
            sampler = sampler_for(request, self.lib, self.vocab, self.n_vocab)
        except GrammarError as exc:
            return Failed(f"response_format: {exc}", rid, field="response_format")
        node = (NodeSampler.of(self.lib, request, self.ends(), self.n_vocab)
                if self.on_node and coordinator_reason(request) is None else None)
        for token in prompt:
            sampler.accept(token, generated=False)  # the penalties look back over the prompt too, as llama-server's
            if node is not None:
                node.accept(token)
        if node is not None:
            # The node draws when it computes an output, before the step's tokens are taken: the draws of the
            # replayed tokens must come first, or the first new token would take the last replayed one's.
            for token in request.replay:
                node.replayed(token)
        return Slot(request, seq=-1, prompt=prompt,
                    budget=min(request.max_tokens, self.context - len(prompt)) - len(request.replay),
                    choose=self._without_ends(sampler.choose) if request.ignore_eos else sampler.choose,
                    accept=sampler.accept, replayed=sampler.replayed, explain=self.logprobs, node=node,
                    draft=self.draft(request, prompt))

    def draft(self, request: Generate, prompt: list[int]) -> Draft | None:
        """The request's drafts, from its tokens so far (after a restart, its replayed ones too): the draft model's
        when there is one, else n-grams; None when it speculates not (speculative off, or speculative.n_max 0)."""
        limit = DRAFT_MAX if request.draft_max is None else min(request.draft_max, DRAFT_MAX)
        if not self.speculative or not limit:
            return None
        tokens = prompt + list(request.replay)
        if self.draft_model is not None:
            return self.draft_model.sequence(tokens, limit)
        return NgramDraft(tokens, limit)

    def ends(self) -> np.ndarray:
        """The end-of-text (and end-of-turn) tokens."""
        if self._ends is None:  # once per model: one call per vocabulary entry
            self._ends = np.array([token for token in range(self.n_vocab)
                                   if self.lib.llama_vocab_is_eog(self.vocab, token)], dtype=np.int64)
        return self._ends

    def _without_ends(self, choose: Choose) -> Choose:
        """``choose`` that never picks an end-of-text token (llama-server's ignore_eos: their logits at -inf)."""
        ends = self.ends()

        def chosen(logits: np.ndarray) -> int:
            logits[ends] = -np.inf  # in llama.cpp's buffer of this step: logprobs see them at -inf, as chosen
            return choose(logits)

        return chosen

    def logprobs(self, token: int, found: Logprobs) -> TokenLogprobs:
        """A chosen token's log-probability and the likeliest tokens', with their texts."""
        return {**self._piece(token, found.logprob),
                "top_logprobs": [self._piece(other, logprob) for other, logprob in found.top]}

    def _piece(self, token: int, logprob: float) -> TopLogprob:
        piece = self.llm.detokenize([token])
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


def _read_requests(generator: Generator, requests: queue.Queue[Request | None], out: IO[str]) -> None:
    """Read stdin in its own thread, so that a cancel reaches a request while it generates."""
    for line in sys.stdin:
        try:
            request = decode_request(line)
        except ValueError as exc:
            emit(out, Failed(f"bad request: {exc}"))
            continue
        if isinstance(request, Cancel):
            generator.requests.cancel(request.id)
            continue
        if isinstance(request, Generate):
            generator.requests.opened(request.id)
        requests.put(request)
    requests.put(None)


_EMIT = threading.Lock()  # the stdin reader thread may answer too


def emit(out: IO[str], message: Answer, *, flush: bool = True) -> None:
    """Write one protocol line, and flush it unless the caller flushes later (``flush``)."""
    with _EMIT:
        out.write(encode(message).decode())
        if flush:
            out.flush()


def flush(out: IO[str]) -> None:
    """Send what was written without a flush."""
    with _EMIT:
        out.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the coordinator child process."""
    parser = argparse.ArgumentParser(description="ggml-cluster coordinator (started by the controller)")
    parser.add_argument("config", help="CoordinatorConfig as JSON")
    args = parser.parse_args(argv)
    config = CoordinatorConfig.from_json(args.config)
    out = sys.stdout
    started = time.perf_counter()
    try:
        compute = register_rpc_servers(config.endpoints)
        generator = Generator.load(config, compute)
    except (RuntimeError, ValueError, OSError) as exc:
        emit(out, Failed(f"cannot load the model: {exc}"))
        return 1
    emit(out, Ready(time.perf_counter() - started, generator.context, generator.n_vocab))
    requests: queue.Queue[Request | None] = queue.Queue()
    threading.Thread(target=_read_requests, args=(generator, requests, out), daemon=True).start()
    # A step's answers (a token of each sequence) leave in one write, flushed by serve after the step: one wakeup
    # of the controller per step, not per sequence.
    scheduler = Scheduler(LlamaEngine(generator), config.parallel, lambda message: emit(out, message, flush=False),
                          generator.requests)
    try:
        serve(generator, scheduler, requests, lambda: flush(out))
    except PersistentComputeFailure:
        return EXIT_COMPUTE_FAILED  # the controller restarts the worker and this process, then replays
    finally:
        flush(out)
    return 0


def serve(generator: Generator, scheduler: Scheduler, requests: queue.Queue[Request | None],
          send: Callable[[], None]) -> None:
    """Admit requests as they come and step the slots until a Shutdown (or stdin's end) with nothing in flight;
    ``send`` flushes the answers written, around each step and before waiting for a request.

    Requests are read between steps, so one that arrives while others generate joins them at the next step.
    """
    stopping = False
    while not stopping or scheduler.busy:
        while not stopping:
            busy = scheduler.busy
            if not busy:
                send()  # nothing runs: an answer written must not wait for the next request
            try:
                request = requests.get(block=not busy)
            except queue.Empty:
                break
            if request is None or isinstance(request, Shutdown):
                stopping = True  # after what is in flight, as a request queued before it would be
            elif isinstance(request, Generate):
                prepared = generator.prepare(request)
                if isinstance(prepared, Failed):
                    scheduler.emit(prepared)
                    generator.requests.closed(request.id)
                else:
                    scheduler.add(prepared)
        send()  # the new requests' prompt tokens, before a step that may take long (an empty buffer: no write)
        scheduler.step()
        send()


if __name__ == "__main__":
    sys.exit(main())
