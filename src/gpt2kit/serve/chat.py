"""/v1/chat/completions: the messages rendered by a chat template into one prompt, completed as
/v1/completions completes it (serve/completions.py plans and runs it), answered as a chat completion,
whole or streamed as `chat.completion.chunk` events.

The template is the one given with --chat-template, else the model directory's own (as transformers
saves it: chat_template.jinja, or tokenizer_config.json's "chat_template", beside the vocabulary
files), else DEFAULT_TEMPLATE. GPT-2 was not trained on chat: the default is a plain transcript that
a language model can continue, and a completion under it stops where the model starts the next
user turn (TURN_STOPS).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import gpt2kit.serve.schemas as S
from gpt2kit.serve.completions import stream_objects
from gpt2kit.serve.errors import APIError

if TYPE_CHECKING:
    from fastapi import Request

    from gpt2kit.serve.completions import Job
    from gpt2kit.serve.server import Server
    from gpt2kit.tokenizer import Tokenizer

log = logging.getLogger("gpt2kit.serve")

# A system message is the transcript's preamble; every other turn is "Role: content" on its own line,
# and the completion continues after "Assistant:".
DEFAULT_TEMPLATE = (r"{% for m in messages %}{% if m.role == 'system' %}{{ (m.content or '') ~ '\n\n' }}"
                    r"{% else %}{{ m.role | capitalize ~ ': ' ~ (m.content or '') ~ '\n' }}{% endif %}{% endfor %}"
                    r"{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
TURN_STOPS = ("\nUser:",)  # where DEFAULT_TEMPLATE's next turn begins
EXTENSIONS = {*S.Extensions.model_fields, "best_of"}  # passed to the completion as sent


def resolve(given: str | None, tokenizer: Tokenizer) -> tuple[str, tuple[str, ...], str]:
    """(the template, the stop strings it adds, where it came from): --chat-template's, the model's,
    or the default with its turn marker as a stop."""
    if given is not None:
        return given, (), "--chat-template"
    found = model_template(tokenizer)
    if found is not None:
        return found[0], (), found[1]
    return DEFAULT_TEMPLATE, TURN_STOPS, "the default transcript template"


def model_template(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The chat template saved beside the model's vocabulary files, and its file; None when there is none.
    A tokenizer_config.json that is not JSON is logged and passed over (the default serves)."""
    vocab = getattr(tokenizer, "vocab_path", None)
    if vocab is None:
        return None
    folder = Path(vocab).parent
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace"), str(jinja)
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_bytes())
    except (ValueError, OSError) as e:
        log.warning("%s: not read for a chat template (%s)", config, type(e).__name__)
        return None
    found = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(found, list):  # transformers' named templates: the one named "default"
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return (found, str(config)) if isinstance(found, str) and found.strip() else None


def render(template: str, body: S.ChatRequest, eot_text: str) -> str:
    """The messages as one prompt (add_generation_prompt set; bos_token and eos_token are <|endoftext|>,
    as transformers passes them); a template that fails is a 400."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise APIError(400, "chat templates need Jinja2: pip install 'gpt2kit[serve]'") from None

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=[m.model_dump() for m in body.messages],
                                                add_generation_prompt=True, bos_token=eot_text, eos_token=eot_text,
                                                raise_exception=raise_exception)
    except Exception as e:  # a template error is the request's (or the operator's) problem
        raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param="messages") from None


def completion_request(body: S.ChatRequest, prompt: str) -> S.CompletionRequest:
    """The /v1/completions request that completes the rendered prompt with the chat request's settings."""
    max_tokens = body.max_completion_tokens or body.max_tokens
    return S.CompletionRequest(
        model=body.model, prompt=prompt, max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=body.temperature, top_p=body.top_p, n=body.n, stop=body.stop, stream=body.stream,
        stream_options=body.stream_options, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias, seed=body.seed, user=body.user,
        **body.model_dump(include=EXTENSIONS, exclude_unset=True, by_alias=True))


def response(out: dict) -> dict:
    """The whole completion as a chat completion."""
    return {"id": _chat_id(out["id"]), "object": "chat.completion", "created": out["created"], "model": out["model"],
            "usage": out["usage"], "choices": [_choice(c) for c in out["choices"]]}


def _chat_id(completion_id: str) -> str:
    return completion_id.replace("cmpl-", "chatcmpl-", 1)


def _choice(c: dict) -> dict:
    choice = {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
              "finish_reason": c["finish_reason"], "logprobs": None}
    if "score" in c:  # beam search
        choice["score"] = c["score"]
    return choice


async def stream(server: Server, job: Job, request: Request) -> AsyncIterator[str]:
    """The completion as OpenAI streams a chat completion: for each choice a first chunk with the role,
    then its content in deltas, then a chunk with an empty delta and its finish_reason; with
    stream_options.include_usage every chunk has "usage": null and a last chunk, without choices, the
    usage; then `data: [DONE]`. An error ends the stream as on /v1/completions: an error event, [DONE]."""
    include_usage = bool(job.body.stream_options and job.body.stream_options.include_usage)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        obj = {"id": _chat_id(job.id), "object": "chat.completion.chunk", "created": job.created,
               "model": job.body.model, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def delta(index: int, change: dict, finish_reason: str | None = None) -> dict:
        return {"index": index, "delta": change, "logprobs": None, "finish_reason": finish_reason}

    for index in range(len(job.prompts) * job.n):
        yield chunk([delta(index, {"role": "assistant", "content": ""})])
    async with contextlib.aclosing(stream_objects(server, job, request)) as objects:
        async for obj in objects:
            if "error" in obj:
                yield f"data: {json.dumps(obj)}\n\n"
                continue
            for c in obj["choices"]:
                if c["text"]:
                    yield chunk([delta(c["index"], {"content": c["text"]})])
                if c["finish_reason"] is not None:
                    yield chunk([delta(c["index"], {}, c["finish_reason"])])
            if not obj["choices"] and include_usage:
                yield chunk([], obj.get("usage"))
    yield "data: [DONE]\n\n"
