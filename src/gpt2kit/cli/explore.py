"""gpt2kit explore: the forward pass live in a browser, on this machine only (docs/explore.md)."""

from __future__ import annotations

import argparse
import sys

from gpt2kit.cli.common import CLIError
from gpt2kit.cli.load import add_model_args, add_quantize_arg, check_adapter, check_load_args, load_for


def cmd_explore(args: argparse.Namespace) -> int:
    import importlib

    for module in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise CLIError(f"gpt2kit explore needs FastAPI and uvicorn ({module} is missing): "
                           f"pip install 'gpt2kit[serve]'") from None
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    check_load_args(args)  # before the model loads
    check_adapter(args)
    from gpt2kit.serve.explore_app import bind, server_for
    from gpt2kit.trace.explore import Explorer

    sock = bind(args.port)  # a port in use fails before the model loads
    try:
        model, tok = load_for(args)
        args.status.hide()
        server = server_for(Explorer(model, tok, name=str(args.model)))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        print(f"gpt2kit explore: {url} (Ctrl-C stops it)", flush=True)
        if args.open:
            import webbrowser

            if not webbrowser.open(url):
                print("gpt2kit explore: warning: no browser could be started; open the URL yourself", file=sys.stderr)
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def register_explore(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explore", help="the forward pass live in your browser: tokens, attention, the logit lens, "
                                       "a block step by step, sampling (needs gpt2kit[serve])",
                       description="Serve one page on 127.0.0.1 (this machine only; nothing is fetched from "
                                   "elsewhere, so it works offline): type a text and see every view of "
                                   "`gpt2kit trace` update, step through one block for a position and head, and "
                                   "generate token by token with the sampling settings. See docs/explore.md.")
    add_model_args(p)
    p.add_argument("--port", type=int, default=8001, help="port on 127.0.0.1 (default 8001; 0 = any free port)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    add_quantize_arg(p)
    p.set_defaults(func=cmd_explore)
