"""ServeOptions: what a server is asked to do, validated here, and the one description of each
setting. Each field's metadata holds its help (and optionally a metavar, or a flag of another name
that stores const); `gpt2kit serve`'s flags are built from these fields. No torch and no FastAPI
here, so `gpt2kit serve --help` answers without importing either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpt2kit.validate import check_int


def _setting(default: Any, help: str, **cli: Any) -> Any:
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class ServeOptions:
    served_model_name: str = _setting("gpt2", "the model name clients send (default: --model)")
    max_batch: int = _setting(8, "rows decoded together at most (default 8)")
    max_queue: int = _setting(64, "rows waiting at most; beyond: 429 (default 64)")
    # chunked prefill (gpt2kit.engine.prefill; docs/serving.md): the running rows decode between chunks
    prefill_chunk: int = _setting(128, "prompt tokens prefilled per decode step at most, so a long prompt joins in "
                                       "chunks while the running rows go on getting a token every step (default 128)",
                                  metavar="TOKENS")
    prefill_idle_budget: int | None = _setting(
        None, "prompt tokens prefilled in a step while no row decodes (nothing to protect then), so a burst of "
              "prompts joining an idle server gets its first tokens after one step; at least --prefill-chunk, each "
              "prompt still cut in chunks of --prefill-chunk (default: one chunk of every joining row, i.e. up to "
              "--max-batch x --prefill-chunk)", metavar="TOKENS")
    admission_window: float = _setting(
        0.008, "seconds an idle engine waits after a request arrives for others to join its first step, so a "
               "burst is prefilled in one forward instead of the first request alone then the rest (default 0.008; "
               "0: start at once)", metavar="SECONDS")
    max_tokens_per_request: int | None = _setting(None, "cap on max_tokens (default: n_ctx)")
    api_key: str | None = _setting(
        None, "require 'Authorization: Bearer KEY' (all but /health); visible in the process list: prefer "
              "--api-key-file or $GPT2KIT_API_KEY", metavar="KEY")
    # the template's text (Jinja2), or None: the model's own, else serve/template.py's DEFAULT_TEMPLATE
    chat_template: str | None = _setting(None, "a Jinja2 template over `messages` for /v1/chat/completions (default: "
                                               "the model directory's own, else a plain User:/Assistant: transcript)")
    max_body_bytes: int = _setting(1 << 20, "a request body's size at most, else 413 (default 1 MiB)",
                                   metavar="BYTES")
    # The prefix cache (gpt2kit.prefix_cache): generation's prompt blocks and echo scoring's prompts, in tokens
    prefix_cache_tokens: int = _setting(
        2048, "keep the keys and values of up to TOKENS prompt tokens (generation's prompts in blocks of 16, echo "
              "log-probs' scored prompts), so a prompt sharing a prefix with an earlier one runs only the rest "
              "through the model (memory: 2 x n_layer x n_embd values per token, e.g. 72 KiB for gpt2 in float32); "
              "0: off (default 2048)", metavar="TOKENS")
    pack_weights: bool | None = _setting(None, "CPU: no prepacked second copy of the weights",
                                         flag="--no-pack-weights", const=False)
    # Connection lifecycle (serve/gate.py, serve/runner.py; docs/serving.md): seconds.
    # after SIGTERM: in-flight requests may finish; then they are ended
    shutdown_grace: float = _setting(20.0, "on SIGTERM/SIGINT: refuse new requests (503) and let in-flight ones "
                                           "finish for up to SECONDS, then end them with an error (default 20)",
                                     metavar="SECONDS")
    # for a request's headers, then again for its body
    read_timeout: float = _setting(30.0, "a request's headers, then its body, must arrive within SECONDS, else 408 "
                                         "(default 30)", metavar="SECONDS")
    # an idle connection after a response
    keep_alive_timeout: float = _setting(5.0, "close a connection idle this long after a response (default 5)",
                                         metavar="SECONDS")
    # Host names besides the loopback ones; "*": any
    allowed_hosts: tuple[str, ...] = _setting(
        (), "comma list of Host names (name or name:port) accepted besides localhost, 127.0.0.1 and [::1]; "
            "checked on loopback addresses always, elsewhere only if given; '*': any", metavar="NAMES")
    # Speculative decoding for every eligible (greedy) request (gpt2kit.engine.speculate; docs/serving.md)
    draft_model: str | None = _setting(None, "a smaller GPT-2 with the same tokenizer drafts for every greedy request",
                                       metavar="M")
    draft_tokens: int = _setting(4, "tokens --draft-model proposes per step (1 .. 64)", metavar="K")
    # Many LoRA adapters on one base (gpt2kit.lora.enable_multi_lora): (name, directory) pairs
    loras: tuple[tuple[str, str], ...] = _setting(
        (), "a LoRA adapter (peft's format) served beside the base as model NAME, its rows batched with the "
            "base's and other adapters' (repeat for more)", metavar="NAME=DIR")
    max_loras: int = _setting(8, "LoRA adapters served at most (default 8)", metavar="N")
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (serve/adapters.py; docs/serving.md)
    allow_runtime_lora: bool = _setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA updating): "
               "adapters from directories on this server added and removed while it runs, behind --api-key")
    prompt_lookup: int = _setting(0, "every greedy request drafts up to N tokens per step from n-gram matches in its "
                                     "context (0 = off; at most 64)", metavar="N")
    # Interventions a request may carry (serve/interventions.py; docs/serving.md)
    allow_interventions: bool = _setting(False, "accept a request's `interventions` (head ablations, steering "
                                                "vectors and SAE clamps named from --steer-vector and --sae)")
    max_interventions: int = _setting(8, "interventions one request may carry at most (default 8)", metavar="N")
    # NAME=FILE / NAME=DIR pairs: the only vectors and SAEs a request can name
    steer_vectors: tuple[str, ...] = _setting((), "a steering vector requests may name: NAME=FILE.npy (repeatable)")
    saes: tuple[str, ...] = _setting((), "an SAE (SAELens's format) requests may clamp: NAME=DIR (repeatable)")

    def __post_init__(self) -> None:
        check_int("ServeOptions.max_batch", self.max_batch, ">= 1", lambda v: v >= 1)
        check_int("ServeOptions.max_queue", self.max_queue, ">= 0", lambda v: v >= 0)
        check_int("ServeOptions.prefill_chunk", self.prefill_chunk, ">= 1", lambda v: v >= 1)
        if self.prefill_idle_budget is not None:
            check_int("ServeOptions.prefill_idle_budget", self.prefill_idle_budget,
                      f">= prefill_chunk={self.prefill_chunk} (or None: max_batch x prefill_chunk)",
                      lambda v: v >= self.prefill_chunk)
        if self.max_tokens_per_request is not None:
            check_int("ServeOptions.max_tokens_per_request", self.max_tokens_per_request, ">= 1 (or None: n_ctx)",
                      lambda v: v >= 1)
        check_int("ServeOptions.prefix_cache_tokens", self.prefix_cache_tokens, ">= 0 (0: off)", lambda v: v >= 0)
        check_int("ServeOptions.max_body_bytes", self.max_body_bytes, ">= 1", lambda v: v >= 1)
        if not isinstance(self.admission_window, int | float) or not 0.0 <= self.admission_window <= 1.0:
            raise ValueError(f"ServeOptions.admission_window must be seconds in [0, 1], got {self.admission_window!r}")
        for name, least in (("shutdown_grace", 0.0), ("read_timeout", 1e-3), ("keep_alive_timeout", 1e-3)):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not least <= value < math.inf:
                raise ValueError(f"ServeOptions.{name} must be a finite number of seconds >= {least:g}, "
                                 f"got {value!r}")
        self.allowed_hosts = tuple(self.allowed_hosts)
        check_int("ServeOptions.draft_tokens", self.draft_tokens, "in [1, 64]", lambda v: 1 <= v <= 64)
        check_int("ServeOptions.prompt_lookup", self.prompt_lookup, "in [0, 64] (0 = off)", lambda v: 0 <= v <= 64)
        check_int("ServeOptions.max_interventions", self.max_interventions, "in [1, 64]", lambda v: 1 <= v <= 64)
        self.steer_vectors, self.saes = tuple(self.steer_vectors), tuple(self.saes)
        for what, pairs in (("steer_vectors", self.steer_vectors), ("saes", self.saes)):
            names = [p.partition("=")[0] for p in pairs]
            bad = [p for p in pairs if not (p.partition("=")[0] and p.partition("=")[2]) or ":" in p.partition("=")[0]]
            if bad or len(set(names)) < len(names):
                raise ValueError(f"ServeOptions.{what}: each is NAME=PATH with a unique NAME (no ':'), got "
                                 f"{bad or names}")
        if self.draft_model is not None and self.prompt_lookup:
            raise ValueError("ServeOptions: draft from a draft model or by prompt lookup, not both")
        self._check_loras()

    def _check_loras(self) -> None:
        check_int("ServeOptions.max_loras", self.max_loras, ">= 1", lambda v: v >= 1)
        self.loras = tuple((str(n), str(d)) for n, d in self.loras)
        names = [n for n, _ in self.loras]
        if len(names) > self.max_loras:
            raise ValueError(f"ServeOptions.loras: {len(names)} adapters, more than max_loras={self.max_loras}")
        for name in names:
            if not name or name == self.served_model_name or names.count(name) > 1:
                raise ValueError(f"ServeOptions.loras: adapter name {name!r} must be non-empty, unique and not the "
                                 f"base's name {self.served_model_name!r}")
        if (names or self.allow_runtime_lora) and (self.draft_model is not None or self.prompt_lookup):
            raise ValueError("ServeOptions: LoRA adapters (loras, allow_runtime_lora) are not served with "
                             "speculative decoding (draft_model, prompt_lookup)")
