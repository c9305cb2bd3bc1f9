"""/v1/chat/completions: the messages rendered by a chat template (serve/template.py) into one
prompt, completed as /v1/completions completes it (serve/completions.py plans and runs it), answered
as a chat completion, whole or streamed as `chat.completion.chunk` events.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import gpt2kit.serve.schemas as S
from gpt2kit.serve.completions import stream_objects

if TYPE_CHECKING:
    from fastapi import Request

    from gpt2kit.serve.job import Job
    from gpt2kit.serve.server import Server

EXTENSIONS = {*S.Extensions.model_fields, "best_of"}  # passed to the completion as sent


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
