"""A completion's response, built the same way whole and streamed: each choice's echoed prompt,
its tokens' log-probs continuing the same text offsets, the envelope every object shares, and
the usage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpt2kit.serve.logprobs import Offsets, logprobs_obj

if TYPE_CHECKING:
    from gpt2kit.serve.job import Job
    from gpt2kit.tokenizer import Tokenizer


def usage(job: Job) -> dict:
    prompt = sum(map(len, job.prompts))
    done = sum(len(c.tokens) for c in job.choices.values())
    done += sum(len(b.tokens) for beams in job.found.values() for b in beams)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


class Response:
    """The completion's parts, for the whole response and for each streamed chunk alike: a choice
    begins with its prompt (echoed text, its log-probs), its tokens' log-probs continue the same
    text offsets, and every object has the same envelope."""

    def __init__(self, tokenizer: Tokenizer, job: Job, prompt_lp: list[tuple[list, list]] | None) -> None:
        self.tok, self.job, self.prompt_lp = tokenizer, job, prompt_lp
        self.offsets: dict[object, Offsets] = {}

    def begin(self, key: object, i: int) -> tuple[str, dict | None]:
        """Choice `key` of prompt i begins: its echoed text ('' without echo) and, with echo and
        logprobs, the prompt's logprobs object; its offsets then start past the prompt."""
        body, off = self.job.body, Offsets(self.tok)
        self.offsets[key] = off
        text = self.job.prompt_texts[i] if body.echo else ""
        if body.logprobs is not None and body.echo:
            return text, logprobs_obj(self.tok, self.job.prompts[i], *self.prompt_lp[i], off)
        for t in self.job.prompts[i]:
            off.feed(t)
        return text, None

    def tokens(self, key: object, tokens, lps, tops, before: dict | None = None) -> dict | None:
        """The logprobs object of choice `key`'s tokens (None without logprobs), after `before`."""
        if self.job.body.logprobs is None:
            return before
        lp = logprobs_obj(self.tok, tokens, lps, tops, self.offsets[key])
        return lp if before is None else {k: before[k] + lp[k] for k in lp}

    def envelope(self, choices: list[dict]) -> dict[str, Any]:
        job = self.job
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.body.model,
                "choices": choices}


def choice_obj(text: str, index: int, lp: dict | None, finish_reason: str | None) -> dict:
    return {"text": text, "index": index, "logprobs": lp, "finish_reason": finish_reason}
