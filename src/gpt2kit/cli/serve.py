"""gpt2kit serve. Its flags are ServeOptions' fields (gpt2kit.serve.options, which validates them);
the few whose command-line form differs (the served name's default, the chat template's file, the
API key's file, the comma list of hosts) and the address are the flags below."""

from __future__ import annotations

import argparse
import sys

from gpt2kit.cli.common import CLIError, DefaultsShown, add_field_flags, field_values, read_text
from gpt2kit.cli.load import add_model_args, add_quantize_arg, check_adapter, check_load_args
from gpt2kit.serve.options import ServeOptions

_BY_HAND = ("served_model_name", "chat_template", "allowed_hosts", "steer_vectors", "saes", "loras")


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise CLIError(f"gpt2kit serve needs FastAPI, uvicorn and prometheus_client ({module} is missing): "
                           f"pip install 'gpt2kit[serve]'") from None
    from gpt2kit.serve.auth import resolve_api_key
    from gpt2kit.serve.runner import serve

    values = field_values(args, args.serve_fields)
    ServeOptions(**values)  # bad values fail before anything is read or loaded
    check_load_args(args)  # before the model loads
    check_adapter(args)  # a bad adapter fails before the server starts
    loras = check_loras(args.lora)
    template = read_text(args.chat_template) if args.chat_template is not None else None
    values["api_key"], warnings = resolve_api_key(args.api_key, args.api_key_file)
    for w in warnings:
        print(f"gpt2kit serve: warning: {w}", file=sys.stderr)
    hosts = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    opts = ServeOptions(**values, served_model_name=args.served_model_name or args.model, chat_template=template,
                        allowed_hosts=hosts, steer_vectors=tuple(args.steer_vector), saes=tuple(args.sae),
                        loras=loras)
    print(f"gpt2kit serve: loading {args.model} as {opts.served_model_name!r} on http://{args.host}:{args.port}"
          f" (/health answers 503 until it is ready)", file=sys.stderr, flush=True)
    serve(args.model, host=args.host, port=args.port, dtype=args.dtype, device=args.device, opts=opts,
          quantize=args.quantize, adapter=args.adapter, gate_data=args.gate_data if args.int8_activations else None)
    return 0


def check_loras(given: list[str] | None) -> tuple[tuple[str, str], ...]:
    """--lora NAME=DIR values as (name, directory), each adapter read and checked before the server starts."""
    from gpt2kit.checkpoint import read_adapter

    loras = []
    for value in given or []:
        name, eq, directory = value.partition("=")
        if not eq or not name.strip() or not directory.strip():
            raise CLIError(f"--lora takes NAME=DIR (a model name and an adapter directory), got {value!r}")
        read_adapter(directory.strip())
        loras.append((name.strip(), directory.strip()))
    return tuple(loras)


def register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (needs gpt2kit[serve])",
                       formatter_class=DefaultsShown)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    fields = add_field_flags(p, ServeOptions, skip=_BY_HAND)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from PATH (one line; keep it chmod 600)")
    help = {f: ServeOptions.__dataclass_fields__[f].metadata["help"] for f in _BY_HAND}
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES", help=help["allowed_hosts"])
    p.add_argument("--served-model-name", default=None, help=help["served_model_name"])
    p.add_argument("--chat-template", default=None, metavar="FILE", help=help["chat_template"])
    p.add_argument("--steer-vector", action="append", default=[], metavar="NAME=FILE", help=help["steer_vectors"])
    p.add_argument("--sae", action="append", default=[], metavar="NAME=DIR", help=help["saes"])
    p.add_argument("--lora", action="append", default=None, metavar="NAME=DIR", help=help["loras"])
    add_quantize_arg(p)
    p.set_defaults(func=cmd_serve, serve_fields=fields)
