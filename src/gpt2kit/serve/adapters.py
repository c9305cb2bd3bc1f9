"""LoRA adapters added and removed while the server runs (--allow-runtime-lora): vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter over the model's adapter bank
(gpt2kit.lora.AdapterBank), with vLLM's bodies and plain-text answers.

The bank changes in the engine's worker thread, between steps (EngineLoop.call, call_steps), never
during one. Loading reads and checks the directory as --lora does (peft's format, every check of
gpt2kit.checkpoint.adapter.add_adapter), so a bad one is a 400 naming what is wrong and nothing
changes; the name is served (/v1/models, requests) once the adapter is in the bank. Unloading takes
the name out of /v1/models and out of reach of new requests at once (404 from then on), lets the
rows already admitted on the adapter finish on it, then frees its slot and answers: a running row
never sees its adapter vanish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gpt2kit.serve.errors import APIError

if TYPE_CHECKING:
    from gpt2kit.engine import Engine
    from gpt2kit.model import GPT2
    from gpt2kit.serve.server import Server


async def load(server: Server, name: str, path: str) -> str:
    """Add the adapter at `path` (a directory on the server) as model `name`; vLLM's success text."""
    server.require_ready()
    if not name or not path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       param="lora_path" if name else "lora_name")
    if name == server.opts.served_model_name or name in server.adapters:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded." if name in server.adapters else
                       f"'{name}' is the base model's name; choose another", param="lora_name")
    try:
        index = await server.run_in_worker(_add, server.model, name, path, server.opts.max_loras)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError; a missing file an OSError
        raise APIError(400, f"cannot load LoRA adapter '{name}': {e}", param="lora_path") from None
    server.adapters[name], server.adapter_roots[name] = index, path
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(server: Server, name: str) -> str:
    """Stop serving adapter `name` now and drop it once its running rows are done; vLLM's success text."""
    server.require_ready()
    if name not in server.adapters:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    index = server.adapters.pop(name)  # no request planned from here on gets it
    server.adapter_roots.pop(name)
    done = server.engine_loop.call_steps(_drain(server.model, server.engine_loop.engine, name, index))
    await asyncio.shield(asyncio.wrap_future(done))  # a client gone meanwhile does not stop the removal
    return f"Success: LoRA adapter '{name}' removed successfully."


def _add(model: GPT2, name: str, path: str, limit: int) -> int:
    """In the worker: add_adapter, within the server's --max-loras (adapters still finishing count)."""
    from gpt2kit.checkpoint.adapter import add_adapter

    held = len(model.adapter_bank.adapters)
    if held >= limit:
        raise ValueError(f"{held} adapters are loaded, the most this server holds (--max-loras {limit}); "
                         "unload one first")
    return add_adapter(model, name, path)


def _drain(model: GPT2, engine: Engine, name: str, index: int) -> Iterator[None]:
    """In the worker, one step at a time: wait until no row the engine holds runs slot `index`, then
    drop the adapter from the bank."""
    from gpt2kit.engine.scheduler import runs_adapter

    while runs_adapter(engine, index):
        yield
    model.adapter_bank.remove(name)
