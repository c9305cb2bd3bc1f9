"""Running the app under uvicorn: serve() (load a checkpoint, serve it until interrupted), connection
timeouts, the graceful shutdown and the ready line.

- Timeouts: uvicorn's keep-alive timeout (ServeOptions.keep_alive_timeout) closes a connection
  idle after a response; its h11 protocol is extended with a deadline on request heads
  (ServeOptions.read_timeout, from the connection opening or from the first byte of the next
  request): a connection that never sends a whole head is answered 408 and closed. The body has
  the same deadline from the end of the head (serve/gate.py).
- Shutdown: the first SIGTERM or SIGINT starts a drain: new requests get 503 (the listener stays
  open to say so), in-flight ones go on; when none is left, or ServeOptions.shutdown_grace
  seconds have passed, uvicorn shuts down. At the deadline every request still generating is
  ended cleanly (serve/lifecycle.py). A second signal stops at once.
- Ready: one log line once the model is loaded and the socket listening (address, model,
  dtype, device, quantization).
"""

from __future__ import annotations

import copy
import json
import logging
import signal
import socket
import sys
import time

import h11
import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpt2kit.checkpoint import load_model, load_tokenizer
from gpt2kit.config import check_scheme
from gpt2kit.quant.gate import gate_activations
from gpt2kit.quant.modules import quantization, quantize_model
from gpt2kit.serve.app import create_app
from gpt2kit.serve.errors import error_body
from gpt2kit.serve.options import ServeOptions

log = logging.getLogger("gpt2kit.serve")

_AFTER_ABORT = 5.0  # seconds the ended requests get to send their last event before uvicorn cancels them


def make_server(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for `app` (from create_app) with its ServeOptions' timeouts and shutdown.
    Run it with `.run(sockets=[sock])` or `.run()`."""
    opts = app.state.server.opts
    logging_config = copy.deepcopy(LOGGING_CONFIG)
    logging_config["loggers"]["gpt2kit.serve"] = {"handlers": ["default"], "level": log_level.upper(),
                                                  "propagate": False}
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=logging_config,
                            http=_timed_h11(opts.read_timeout), timeout_keep_alive=opts.keep_alive_timeout,
                            timeout_graceful_shutdown=_AFTER_ABORT)
    return GracefulServer(config)



def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str | None = None,
          device: str | None = None, opts: ServeOptions | None = None, log_level: str = "info",
          sock: socket.socket | None = None, quantize: str | None = None, adapter: str | None = None,
          gate_data: str | None = None) -> None:
    """Load checkpoint `model` (in the background: /health answers 503 until it is ready) and serve
    it until interrupted (SIGTERM/SIGINT: a drain of opts.shutdown_grace seconds, docs/serving.md).
    A model that fails to load stops the server and raises here. quantize: "int8" quantizes the
    loaded weights (gpt2kit.quant.modules, LM head included; docs/quantization.md); adapter: a LoRA adapter
    directory (peft's format) merged into the weights first; gate_data: held-out text on which the
    int8 model must pass the int8-activation quality gate (gpt2kit.quant.gate), then served with int8
    activations (a model that fails it does not load)."""
    if quantize is not None:
        check_scheme(quantize)  # an unknown scheme fails before the server starts

    def loader():
        m = load_model(model, dtype=dtype, device=device, adapter=adapter)
        if quantize is not None:
            m = quantize_model(m, quantize)
        if opts is not None and (opts.loras or opts.allow_runtime_lora):
            add_loras(m, opts.loras)
        tokenizer = load_tokenizer(model)
        if gate_data is not None:
            print(f"gpt2kit serve: {gate_activations(m, tokenizer, gate_data)}", file=sys.stderr, flush=True)
        return m, tokenizer

    app = create_app(loader, opts)
    server = make_server(app, host=host, port=port, log_level=log_level)

    def failed(exc: BaseException) -> None:
        server.should_exit = True

    app.state.server.on_load_error = failed
    server.run(sockets=[sock] if sock is not None else None)
    err = app.state.server.load_error
    if err is not None:
        raise err


def add_loras(model, loras: tuple[tuple[str, str], ...]) -> None:
    """The adapters (name, directory) on the model, each rows' own (gpt2kit.lora.enable_multi_lora)."""
    from gpt2kit.checkpoint.adapter import add_adapter
    from gpt2kit.lora import enable_multi_lora

    enable_multi_lora(model)
    for name, directory in loras:
        add_adapter(model, name, directory)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server with the drain on the first signal and the ready line (see the module doc)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.state = config.app.state.server  # the app's Server: options, lifecycle, model
        self.drain_deadline: float | None = None
        self._announced = self._drain_logged = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_deadline is not None or self.should_exit or sig not in (signal.SIGINT, signal.SIGTERM):
            return super().handle_exit(sig, frame)  # a second signal: stop now
        # Runs in the main thread, which is the event loop's: on_tick picks the drain up.
        self.drain_deadline = time.monotonic() + self.state.opts.shutdown_grace
        self.state.life.draining = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self._announced and self.started and self.state.ready:
            self._announced = True
            log.info("ready: %s", self._describe())
        if self.drain_deadline is None:
            return False
        if not self._drain_logged:  # logged here, not in the signal handler
            self._drain_logged = True
            log.info("shutdown: refusing new requests (503); waiting up to %g s for %d in flight (a second "
                     "signal stops now)", self.state.opts.shutdown_grace, len(self.server_state.tasks))
        if not self.server_state.tasks:
            log.info("shutdown: no request in flight")
            return True
        if time.monotonic() >= self.drain_deadline:
            n = self.state.life.abort_all()
            log.warning("shutdown: the %g s grace ran out; ending %d request(s) still generating "
                        "(--shutdown-grace)", self.state.opts.shutdown_grace, n)
            return True
        return False

    def _describe(self) -> str:
        model = self.state.model
        w = model.wpe.weight  # never quantized: the compute dtype
        q = quantization(model)
        name, port = self.servers[0].sockets[0].getsockname()[:2] if self.servers else (self.config.host,
                                                                                         self.config.port)
        shown = f"[{name}]" if ":" in str(name) else name
        return (f"serving {self.state.opts.served_model_name!r} on http://{shown}:{port} ({w.dtype}, {w.device}, "
                f"quantization {q['scheme'] if q else 'none'})")


def _timed_h11(read_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline on request heads (see the module doc)."""

    class TimedH11(H11Protocol):
        _timer = None
        _partial = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._partial = True
                if self._timer is None:
                    self._arm()
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request head arrived whole
                self._disarm()
                self._partial = False

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._timer = self.loop.call_later(read_timeout, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.transport.is_closing() or not self._between_requests():
                return
            if self._partial:  # half a head: say why before closing
                body = json.dumps(error_body(408, f"the request headers did not arrive within {read_timeout:g} s "
                                                  f"(--read-timeout)", None, "request_timeout")).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return TimedH11
