"""What one request may ask of the server: its body (read whole, up to the byte limit, before the
app sees it), its logit_bias keys (canonical token ids only) and its work, counted in tokens so
that scoring (echo + logprobs) and generation share one limit.

Work is what a request holds while it runs: each generation row its prompt + max_tokens, each
prompt scored for echo log-probs its tokens. The server admits at most max_batch + max_queue
generation rows and (max_batch + max_queue) x n_ctx tokens of work at once (what that many full
rows hold). One request may hold at most its share of each (:func:`request_share`: half the rows,
at least one, and n_ctx tokens of work per row of that), so that it never leaves every other client
a 429; a request over its share is 400, one that would exceed the limits beside the work already
admitted is 429 (docs/serving.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gpt2kit.serve.errors import APIError

# "0", or ASCII digits without a leading zero: no sign, no space, no "²" or "١٢" (str.isdigit takes
# both, and int() reads "١٢" as 12), no "0005" (which would be the same id as "5").
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")


def logit_bias_ids(bias: Mapping[str, float] | None, n_vocab: int) -> dict[int, float]:
    """{token id: bias} from a request's logit_bias; a key that is not a canonical decimal id in
    [0, n_vocab) is a 400 naming it."""
    out: dict[int, float] = {}
    for k, v in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(k) or int(k) >= n_vocab:
            raise APIError(400, f"logit_bias key {k!r} is not a token id: keys must be decimal ids in "
                                f"[0, {n_vocab}) written without sign, spaces or leading zeros", param="logit_bias")
        out[int(k)] = float(v)
    return out


def work_tokens(prompts: Sequence[Sequence[int]], max_tokens: int, rows_per_prompt: int, scored: bool) -> int:
    """The tokens of work a request holds: prompt + max_tokens per generation row, plus each
    prompt's tokens when its log-probs are scored (echo + logprobs)."""
    gen = sum(len(p) + max_tokens for p in prompts) * rows_per_prompt if max_tokens > 0 else 0
    return gen + (sum(map(len, prompts)) if scored else 0)


def request_share(rows: int) -> int:
    """The rows one request may hold of a server's limit of `rows`: half, at least one (its work:
    that many rows of n_ctx tokens)."""
    return max(1, rows // 2)


def check_work(tokens: int, admitted: int, limit: int, share: int) -> None:
    """400 if a request's work is over one request's share of the limit, 429 if it does not fit
    beside the work already admitted."""
    if tokens > share:
        raise APIError(400, f"this request needs {tokens} tokens of work (prompt + max_tokens per row, plus "
                            f"the prompt tokens scored for echo log-probs); one request may hold at most "
                            f"{share} of this server's {limit} ((--max-batch + --max-queue) x n_ctx; a request's "
                            f"share is half the rows, x n_ctx): send fewer or shorter prompts", param="prompt")
    if admitted + tokens > limit:
        raise APIError(429, f"the server is at capacity ({admitted} tokens of work admitted, limit {limit}); "
                            f"retry shortly", code="server_overloaded", headers={"Retry-After": "1"})


async def read_body(receive, limit: int) -> list[dict] | None:
    """The request's messages up to the end of its body (or a disconnect), read before the app sees
    any; None once the body passes limit bytes. Reading it here, not where FastAPI parses it (which
    turns any error into 400 "error parsing the body"), makes a chunked body over the limit a 413."""
    messages, n = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        n += len(message.get("body", b""))
        if n > limit:
            return None
        if not message.get("more_body", False):
            return messages


def replay(messages: list[dict], receive):
    """A receive that gives back the messages already read, then the connection's own (disconnects)."""
    pending = list(reversed(messages))

    async def receive_again() -> dict:
        return pending.pop() if pending else await receive()

    return receive_again
