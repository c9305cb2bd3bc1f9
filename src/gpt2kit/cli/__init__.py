"""The `gpt2kit` command: parse, call one library function, map errors to one line and an exit code.

One module per family of commands, each a `cmd_<name>(args) -> int` with its `register_<name>`:
models.py (tokenize, detokenize, info, convert, quantize, merge), generate.py (generate, score),
train.py (prepare, train), serve.py, trace.py, bench.py, check.py. load.py is loading for inference (the
--quantize check, load_model, quantize, load_tokenizer) in one place; common.py what every command
shares (the one-line error, text input, flags built from a dataclass's fields); entry.py the parser
and `main`, the one place errors become exit codes. Heavy imports (torch, FastAPI) happen inside the
commands, so `gpt2kit --help` and `gpt2kit tokenize` start without them.
"""

from gpt2kit.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
