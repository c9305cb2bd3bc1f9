"""gpt2kit serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `gpt2kit[serve]` extra).

    from gpt2kit.serve import create_app, ServeOptions
    app = create_app(lambda: (model, tokenizer), ServeOptions(served_model_name="gpt2"))

The HTTP layer only: generation is gpt2kit.engine, scoring gpt2kit.score. See
docs/serving.md.
"""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING, Any

from gpt2kit.serve.options import ServeOptions

if TYPE_CHECKING:
    from gpt2kit.serve.app import create_app
    from gpt2kit.serve.runner import make_server

__all__ = ["ServeOptions", "create_app", "make_server", "serve"]


def __getattr__(name: str) -> Any:
    """create_app and make_server on first use: importing gpt2kit.serve.options (the CLI's flags)
    imports neither FastAPI nor torch."""
    if name == "create_app":
        from gpt2kit.serve.app import create_app

        return create_app
    if name == "make_server":
        from gpt2kit.serve.runner import make_server

        return make_server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    from gpt2kit.checkpoint import load_model, load_tokenizer
    from gpt2kit.serve.app import create_app
    from gpt2kit.serve.runner import make_server

    if quantize is not None:
        from gpt2kit.quant.modules import check_scheme

        check_scheme(quantize)  # an unknown scheme fails before the server starts

    def loader():
        m = load_model(model, dtype=dtype, device=device, adapter=adapter)
        if quantize is not None:
            from gpt2kit.quant.modules import quantize_model

            m = quantize_model(m, quantize)
        tokenizer = load_tokenizer(model)
        if gate_data is not None:
            from gpt2kit.quant.gate import gate_activations

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
