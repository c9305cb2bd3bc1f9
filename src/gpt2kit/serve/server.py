"""The server's state: the model, its one engine loop (worker thread) and the counters the routes
share; loading in the background, and the engine's events carried from the worker to the event loop.

Every row of every request joins the one running batch at the next decode step and leaves it when
it finishes (continuous batching). Each event reaches the queue of the request that owns its row
(RowKey.owner) as a RowEvent: a failed step too (RowEvent.failed), so the queue holds one shape.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpt2kit.prefix_cache import PrefixCache
from gpt2kit.serve.errors import APIError
from gpt2kit.serve.interventions import Library
from gpt2kit.serve.lifecycle import Lifecycle
from gpt2kit.serve.memory import HeapTrim, bound_kernel_caches
from gpt2kit.serve.metrics import Metrics
from gpt2kit.serve.template import resolve as resolve_template

if TYPE_CHECKING:
    from gpt2kit.engine import EngineLoop, Row, RowEvent
    from gpt2kit.model import GPT2
    from gpt2kit.serve.options import ServeOptions
    from gpt2kit.tokenizer import Tokenizer

log = logging.getLogger("gpt2kit.serve")


class Server:
    """The model, its engine loop and the bookkeeping the routes share (one per app)."""

    def __init__(self, loader: Callable[[], tuple[GPT2, Tokenizer]], opts: ServeOptions) -> None:
        self.loader, self.opts = loader, opts
        bound_kernel_caches(opts)  # before the model's first oneDNN call (gpt2kit.serve.memory)
        self.model: GPT2 | None = None
        self.tokenizer: Tokenizer | None = None
        self.chat_template: str | None = None  # /v1/chat/completions' template and its stops (serve/template.py)
        self.chat_stops: tuple[str, ...] = ()
        self.engine_loop: EngineLoop | None = None
        self.library = Library()  # the vectors and SAEs requests may name (serve/interventions.py)
        self.adapters: dict[str, int] = {}  # a LoRA adapter's model name: its index in model.adapter_bank
        self.adapter_roots: dict[str, str] = {}  # its directory (/v1/models' root); both: serve/adapters.py
        self.ready = False
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.outstanding = 0  # rows admitted and not finished (event-loop thread only)
        self.work_tokens = 0  # tokens of work admitted and not finished (gpt2kit.serve.limits; event loop)
        self.started = int(time.time())
        self.life = Lifecycle()
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.metrics = Metrics(lambda: self.engine_loop.n_running if self.engine_loop else 0,
                               lambda: self.engine_loop.n_waiting if self.engine_loop else 0,
                               lambda: self.engine_loop.steps if self.engine_loop else 0)
        self.metrics.work_tokens.set_function(lambda: self.work_tokens)
        # prompt prefixes for echo scoring and generation (used by the worker thread only; gpt2kit.prefix_cache)
        self.prefix_cache = PrefixCache(opts.prefix_cache_tokens, on_reuse=self.metrics.prefix_cache_hit_tokens.inc,
                                        on_lookup=self.metrics.prefix_cache_lookup)
        self.metrics.prefix_cache_tokens.set_function(lambda: self.prefix_cache.tokens)

    # -- lifecycle --

    def start(self) -> None:
        self.aloop = asyncio.get_running_loop()
        threading.Thread(target=self._load, name="gpt2kit-load", daemon=True).start()

    def _load(self) -> None:
        from gpt2kit.engine import EngineLoop
        from gpt2kit.serve.engine import serve_engine

        try:
            model, tokenizer = self.loader()
            model.eval()
            o = self.opts
            engine = serve_engine(model, tokenizer, max_batch=o.max_batch, pack_weights=o.pack_weights,
                                  draft_model=o.draft_model, draft_tokens=o.draft_tokens, prompt_lookup=o.prompt_lookup,
                                  prefill_chunk=o.prefill_chunk, prefill_idle_budget=o.prefill_idle_budget,
                                  prefix_cache=self.prefix_cache)
            self.engine_loop = EngineLoop(engine, self._on_events, self._on_error,
                                          admission_window=o.admission_window, tidy=HeapTrim()).start()
            self.library = Library.load(o, model)  # a bad vector or SAE fails the start-up, naming its flag
            self.chat_template, self.chat_stops, source = resolve_template(o.chat_template, tokenizer)
            log.info("chat template: %s", source)
            _index_for_structured_outputs(tokenizer)
            bank = getattr(model, "adapter_bank", None)
            self.adapters = {name: bank.index_of(name) for name in bank.adapters} if bank is not None else {}
            self.adapter_roots = {name: d for name, d in o.loras if name in self.adapters}
            self.model, self.tokenizer = model, tokenizer
            self.ready = True
        except Exception as e:  # reported by /health and to the CLI
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error(e)

    def stop(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.stop()

    def require_ready(self) -> None:
        if not self.ready:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            raise APIError(503, "the model is loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})

    # -- engine events (worker thread -> event loop) --

    def _on_events(self, events: list[RowEvent]) -> None:
        self.aloop.call_soon_threadsafe(self._dispatch, events)

    def _on_error(self, rows: list[Row], exc: BaseException) -> None:
        from gpt2kit.engine import RowEvent

        log.error("generation step failed: %s", type(exc).__name__)
        self.aloop.call_soon_threadsafe(self._dispatch, [RowEvent.failed(row, exc) for row in rows])

    def _dispatch(self, events: list[RowEvent]) -> None:
        for ev in events:
            ev.row.key.owner.queue.put_nowait(ev)

    # -- helpers --

    def check_model(self, name: str | None) -> int:
        """The adapter a request's model name runs (its index; -1: the base), else a 404 naming `model`."""
        if name is None or name == self.opts.served_model_name:
            return -1
        if name in self.adapters:
            return self.adapters[name]
        served = ", ".join(f"`{n}`" for n in [self.opts.served_model_name, *self.adapters])
        raise APIError(404, f"The model `{name}` does not exist; this server serves {served} (send one of those "
                            "names, or start the server with --served-model-name or --lora NAME=DIR to choose them)",
                       param="model", code="model_not_found")

    def piece(self, t: int) -> str | list[int]:
        b = self.tokenizer.decode_bytes([t])
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return list(b)

    async def run_in_worker(self, fn, *args):
        return await asyncio.wrap_future(self.engine_loop.call(fn, *args))


def _index_for_structured_outputs(tokenizer) -> None:
    """With the structured extra installed, llguidance's index of the vocabulary (about a second) is
    built while the model loads, not by the first constrained request on the event loop."""
    try:
        from gpt2kit.sampling.structured import matcher_factory

        matcher_factory(tokenizer)
    except ImportError:
        pass

