"""The coordinator: a child process that runs llama-cpp-python with the workers as RPC devices.

It is a separate process on purpose: llama.cpp's RPC client calls abort() when a worker goes away,
and only this process dies with it. It speaks core.engine.protocol on stdin and stdout: `Ready` or `Failed`
once loaded, then per `Generate` its prompt tokens, progress while the prompt (and a replay) is evaluated, a
token at a time, and `Done`. `Cancel` reaches only the request it names, and only while that request is
queued or running: a cancel for a request already done can never reach a later one. ``messages`` (OpenAI chat
messages) are rendered with the inventory's chat_template (a llama-cpp-python chat format, or a Jinja file), else
with the GGUF's own template.

A `Generate` with ``replay`` holds tokens generated before a restart: the prompt is evaluated in the same
batches as the first time and each replayed token one at a time, exactly as first decoded, so the KV cache and
the output are bit-identical. Progress lines let the controller tell a long prompt from a hung worker.
"""

from __future__ import annotations

import argparse
import codecs
import ctypes
import inspect
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from core.engine.protocol import (
    EXIT_COMPUTE_FAILED,
    Answer,
    Cancel,
    ComputeFailed,
    ComputeRetried,
    Done,
    Failed,
    Generate,
    Progress,
    PromptTokens,
    Ready,
    Request,
    Shutdown,
    Token,
    TokenLogprobs,
    TopLogprob,
    decode_request,
    encode,
)
from core.engine.sampling import GrammarError, logprobs, sampler_for

# llama.cpp's default is `auto`, which turns flash attention on wherever the layer's device runs it; the RPC
# client answers "supported" for every op, so on a cluster auto means on (llama-bench, llama-server and
# llama-cli all run that way). llama-cpp-python can only say on or off, and its default, off, builds a graph
# of ~3 more ops per layer per token: measurably slower on small models.
FLASH_ATTENTION = True
# Where llama-cpp-python loads its libraries from, instead of its own lib/ folder.
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"
PROGRESS_INTERVAL_S = 0.5  # a replay reports how far it got at most this often
# A step whose compute a worker reported failed is retried in place this often, after these pauses (a transient
# fault, such as a device briefly out of memory, may need a moment); then the controller's restart path takes over.
RETRY_DELAYS_S = (0.0, 0.01, 0.1)


@dataclass(frozen=True)
class CoordinatorConfig:
    """What the coordinator loads and where its workers are."""

    model: str
    endpoints: tuple[str, ...]
    tensor_split: tuple[float, ...]
    context: int
    threads: int = 1
    chat_format: str | None = None         # a llama-cpp-python chat format by name, instead of the GGUF's template
    chat_template_file: str | None = None  # a Jinja chat template file, instead of the GGUF's template

    def to_json(self) -> str:
        """Serialise for the child's command line."""
        return json.dumps({"model": self.model, "endpoints": list(self.endpoints),
                           "tensor_split": list(self.tensor_split), "context": self.context,
                           "threads": self.threads, "chat_format": self.chat_format,
                           "chat_template_file": self.chat_template_file})

    @classmethod
    def from_json(cls, text: str) -> CoordinatorConfig:
        """Parse what ``to_json`` wrote."""
        data = json.loads(text)
        return cls(model=data["model"], endpoints=tuple(data["endpoints"]),
                   tensor_split=tuple(data["tensor_split"]), context=int(data["context"]),
                   threads=int(data.get("threads", 1)), chat_format=data.get("chat_format"),
                   chat_template_file=data.get("chat_template_file"))


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


@dataclass(frozen=True)
class ComputeFailure:
    """A failed graph compute that a worker reported (ggml-cluster's patch on ggml-rpc)."""

    endpoint: str
    device: int
    status: int  # enum ggml_status
    failures: int


class _CFailure(ctypes.Structure):
    _fields_ = [("endpoint", ctypes.c_char * 128), ("device", ctypes.c_uint32), ("status", ctypes.c_int32),
                ("failures", ctypes.c_uint32)]  # struct ggml_backend_rpc_compute_failure


class ComputeStatus:
    """The RPC client's record of failed computes reported by the workers, taken after each step.

    A llama-cpp-python built without the patch has no such record: then a failed compute kills the worker and
    this process, as in stock ggml-rpc, and the controller's restart path recovers.
    """

    def __init__(self, rpc: ctypes.CDLL) -> None:
        self._take = getattr(rpc, "ggml_backend_rpc_take_compute_failure", None)
        if self._take is not None:
            self._take.argtypes = [ctypes.POINTER(_CFailure)]
            self._take.restype = ctypes.c_bool

    @property
    def available(self) -> bool:
        """Whether this llama-cpp-python reports failed computes."""
        return self._take is not None

    def take(self) -> ComputeFailure | None:
        """The failure reported since the previous call, if any (an in-process read: no network)."""
        if self._take is None:
            return None
        found = _CFailure()
        if not self._take(ctypes.byref(found)):
            return None
        return ComputeFailure(found.endpoint.decode(errors="replace"), found.device, found.status, found.failures)


class PersistentComputeFailure(RuntimeError):
    """A step kept failing after every retry in place."""


def register_rpc_servers(endpoints: tuple[str, ...]) -> ComputeStatus:
    """Register each endpoint as an RPC backend in llama-cpp-python's own ggml registry.

    llama-cpp-python ignores its `rpc_servers` argument. Load the soname files (libggml.so.0): the
    wheel also ships copies without `.0`, and loading those gives a second, empty registry. From the folder
    llama-cpp-python loaded its libraries from: $LLAMA_CPP_LIB_PATH when set (tests/stock.py's stock RPC
    client), else its own lib/.
    """
    import llama_cpp

    override = os.environ.get(LIB_PATH_ENV)  # read as llama-cpp-python reads it: set, even empty, wins
    lib = Path(override) if override is not None else Path(llama_cpp.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(lib / "libggml.so.0"), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so.0"), mode=ctypes.RTLD_GLOBAL)
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register.restype = None
    for endpoint in endpoints:
        registry = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not registry:
            raise RuntimeError(f"ggml_backend_rpc_add_server({endpoint}) returned no backend")
        ggml.ggml_backend_register(registry)
    return ComputeStatus(rpc)


def last_logits(lib: Any, llm: Any, n_vocab: int) -> np.ndarray:
    """The logits of the last decoded token, without a copy (``lib``: the llama_cpp module).

    Reading them waits for the graph: llama_decode itself may return before it is done.
    """
    return np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))


class Generator:
    """Runs one request at a time on a loaded model."""

    def __init__(self, llm: Any, lib: Any, chat: Chat | None = None, compute: ComputeStatus | None = None) -> None:
        """``llm``: a `llama_cpp.Llama`; ``lib``: the llama_cpp module (its C calls); ``chat``: how chats become
        prompts, or None (chats are refused); ``compute``: the workers' reported compute failures."""
        self.requests = RequestIds()
        self.llm = llm
        self._lib = lib
        self.chat = chat
        self.compute = compute
        self.vocab = lib.llama_model_get_vocab(llm.model)
        self.n_vocab = llm.n_vocab()

    @classmethod
    def load(cls, config: CoordinatorConfig, compute: ComputeStatus | None = None) -> Generator:
        """Load the model across the registered RPC devices."""
        import llama_cpp

        llm = llama_cpp.Llama(
            model_path=config.model, n_gpu_layers=-1, tensor_split=list(config.tensor_split) or None,
            n_ctx=config.context, n_threads=config.threads, n_threads_batch=config.threads,
            flash_attn=FLASH_ATTENTION, logits_all=False, verbose=True)
        return cls(llm, llama_cpp, load_chat(llm, config), compute)

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

    def step(self, tokens: list[int], rid: int, out: IO[str]) -> None:
        """Evaluate ``tokens`` (one batch); a step a worker reports failed is retried in place.

        The failure is read once the step's outputs are in (a failure on the last device arrives with the
        logits), before anything is sampled from them. llama_decode has dropped the KV cells of a step it saw fail;
        one that returned before the report is undone here: eval drops every cell from n_tokens on.
        """
        llm = self.llm
        first_seen: float | None = None
        failed_on = ""
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            start = llm.n_tokens
            error: RuntimeError | None = None
            try:
                llm.eval(tokens)
            except RuntimeError as exc:  # llama_decode's status: a device of this step failed
                error = exc
            self._lib.llama_synchronize(llm.ctx)  # what reading the logits waits for anyway
            failure = self.compute.take() if self.compute is not None else None
            if failure is None:
                if error is not None:
                    raise error
                if first_seen is not None:
                    emit(out, ComputeRetried(failed_on, attempt,
                                             (time.perf_counter() - first_seen) * 1000, rid))
                return
            first_seen = first_seen or time.perf_counter()
            failed_on = failure.endpoint
            llm.n_tokens = start
            persistent = attempt == len(RETRY_DELAYS_S)
            emit(out, ComputeFailed(failure.endpoint, failure.device, failure.status, failure.failures, attempt + 1,
                                    rid, persistent))
            if persistent:
                raise PersistentComputeFailure(f"{failure.endpoint} failed the same step {attempt + 1} times")
            time.sleep(RETRY_DELAYS_S[attempt])

    def generate(self, request: Generate, out: IO[str]) -> None:
        """Run one request, writing its answers to ``out``."""
        rid = request.id
        llm = self.llm
        try:
            prompt_tokens = self.prompt_tokens(request)
        except (ValueError, TypeError, KeyError) as exc:  # jinja2's errors are ValueError/TypeError subclasses
            emit(out, Failed(f"cannot render the chat: {exc}", rid))
            return
        replay = request.replay
        budget = min(request.max_tokens, llm.n_ctx() - len(prompt_tokens)) - len(replay)
        if len(prompt_tokens) >= llm.n_ctx():
            emit(out, Failed(f"the prompt has {len(prompt_tokens)} tokens; the context holds {llm.n_ctx()}", rid))
            return
        try:
            sampler = sampler_for(request, self._lib, self.vocab, self.n_vocab)
        except GrammarError as exc:
            emit(out, Failed(f"response_format: {exc}", rid, field="response_format"))
            return
        emit(out, PromptTokens(rid, prompt_tokens))
        for token in prompt_tokens:
            sampler.accept(token, generated=False)  # the penalties look back over the prompt too, as llama-server's
        started = time.perf_counter()
        llm.reset()
        # The batches Llama.eval itself would make (n_batch), one call each, so that progress shows between them.
        batch = llm.n_batch
        for start in range(0, len(prompt_tokens), batch):
            self.step(prompt_tokens[start:start + batch], rid, out)
            emit(out, Progress(rid, "prompt", min(start + batch, len(prompt_tokens)), len(prompt_tokens)))
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        reported = time.perf_counter()
        for index, token in enumerate(replay, 1):
            sampler.replayed(token)  # its draw, penalty history and grammar step, as when it was first chosen
            decoder.decode(llm.detokenize([token]))
            self.step([token], rid, out)
            if index == len(replay) or time.perf_counter() - reported >= PROGRESS_INTERVAL_S:
                emit(out, Progress(rid, "replay", index, len(replay)))
                reported = time.perf_counter()
        # llama_decode may return while the last batch's graph still runs on the workers: the prompt is done
        # when its logits can be read.
        self._lib.llama_synchronize(llm.ctx)
        prompt_done = time.perf_counter()
        generated, reason = 0, "length"
        while generated < budget:
            if self.requests.cancelled(rid):
                reason = "cancelled"
                break
            logits = last_logits(self._lib, llm, self.n_vocab)
            token = sampler.choose(logits)
            if self._lib.llama_vocab_is_eog(self.vocab, token):
                reason = "stop"
                break
            sampler.accept(token)
            generated += 1
            # Read before the next step overwrites the logits.
            chances = self.logprobs(logits, token, request.logprobs) if request.logprobs is not None else None
            emit(out, Token(rid, token, decoder.decode(llm.detokenize([token])), chances))
            if generated < budget:
                self.step([token], rid, out)
        tail = decoder.decode(b"", final=True)
        finished = time.perf_counter()
        emit(out, Done(rid, reason, tail, prompt_tokens=len(prompt_tokens), replayed_tokens=len(replay),
                       completion_tokens=generated, prompt_s=prompt_done - started, decode_s=finished - prompt_done))


    def logprobs(self, logits: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
        """The chosen token's log-probability and the ``top_n`` likeliest tokens', with their texts."""
        found = logprobs(logits, token, top_n)
        return {**self._piece(token, found.logprob),
                "top_logprobs": [self._piece(other, logprob) for other, logprob in found.top]}

    def _piece(self, token: int, logprob: float) -> TopLogprob:
        piece = self.llm.detokenize([token])
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


class RequestIds:
    """Which requests are queued or running, and which of those were cancelled (shared by two threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[object] = set()
        self._cancelled: set[object] = set()

    def opened(self, rid: object) -> None:
        """A request was queued."""
        with self._lock:
            self._open.add(rid)

    def cancel(self, rid: object) -> None:
        """Cancel a queued or running request; any other id is ignored (its request is done)."""
        with self._lock:
            if rid in self._open:
                self._cancelled.add(rid)

    def cancelled(self, rid: object) -> bool:
        """Whether ``rid`` was cancelled."""
        with self._lock:
            return rid in self._cancelled

    def closed(self, rid: object) -> None:
        """A request is done: forget it."""
        with self._lock:
            self._open.discard(rid)
            self._cancelled.discard(rid)


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


def emit(out: IO[str], message: Answer) -> None:
    """Write one protocol line and flush it."""
    with _EMIT:
        out.write(encode(message).decode())
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
    emit(out, Ready(time.perf_counter() - started, generator.llm.n_ctx(), generator.n_vocab))
    requests: queue.Queue[Request | None] = queue.Queue()
    threading.Thread(target=_read_requests, args=(generator, requests, out), daemon=True).start()
    for request in iter(requests.get, None):
        if isinstance(request, Shutdown):
            break
        if isinstance(request, Generate):
            try:
                generator.generate(request, out)
            except PersistentComputeFailure:
                return EXIT_COMPUTE_FAILED  # the controller restarts the worker and this process, then replays
            except (RuntimeError, ValueError) as exc:
                emit(out, Failed(str(exc), request.id))
            finally:
                generator.requests.closed(request.id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
