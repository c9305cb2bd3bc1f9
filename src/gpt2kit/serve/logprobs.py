"""Log-probs as the completions API reports them, and the echoed prompt's, scored in one forward.

Log-probs are the model's raw distribution (log_softmax of the float32 logits, before temperature,
penalties, bias or top-k/p). Tokens in `logprobs.tokens` and keys of `top_logprobs` are the token's
text when its bytes are valid UTF-8 alone, else ``bytes:\\xNN...`` (OpenAI's convention); should two
ids still share a key in one top_logprobs dict, the later is keyed ``token_id:N`` (docs/serving.md).
"""

from __future__ import annotations

import codecs
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.prefix_cache import PrefixCache
    from gpt2kit.tokenizer import Tokenizer


class Offsets:
    """Character offsets of tokens in a text made of their bytes (the decoder replaces bad bytes)."""

    def __init__(self, tokenizer: Tokenizer, start: int = 0) -> None:
        self.tok, self.pos = tokenizer, start
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> int:
        at = self.pos
        with contextlib.suppress(ValueError):
            self.pos += len(self.utf8.decode(self.tok.decode_bytes([token])))
        return at


def token_key(tokenizer: Tokenizer, t: int) -> str:
    """How token t is named in logprobs: its text when its bytes are valid UTF-8 alone, else
    ``bytes:\\xNN...``, and ``token_id:N`` for an id the tokenizer does not know."""
    try:
        b = tokenizer.decode_bytes([t])
    except ValueError:
        return f"token_id:{t}"
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def top_dict(tokenizer: Tokenizer, top) -> dict[str, float]:
    """top_logprobs of one position, (id, log-prob) pairs -> {key: log-prob}; an id whose key is
    already taken is keyed token_id:N, so no alternative is ever lost."""
    out: dict[str, float] = {}
    for t, lp in top:
        k = token_key(tokenizer, t)
        out[f"token_id:{t}" if k in out else k] = lp
    return out


def logprobs_obj(tokenizer: Tokenizer, tokens, lps, tops, offsets: Offsets) -> dict:
    """The `logprobs` object of a run of tokens (their log-probs, top alternatives: None where
    there are none), text offsets continuing `offsets`."""
    return {"tokens": [token_key(tokenizer, t) for t in tokens], "token_logprobs": list(lps),
            "top_logprobs": [None if t is None else top_dict(tokenizer, t) for t in tops],
            "text_offset": [offsets.feed(t) for t in tokens]}


def prompt_logprobs(model: GPT2, tokens: list[int], top: int, cache: PrefixCache | None = None
                    ) -> tuple[list[float | None], list]:
    """(log-probs of the prompt's tokens, first None; top-N alternatives, first None), from one
    forward over the prompt (gpt2kit.score.score_tokens_top), or over the part of it past the
    longest prefix it shares with a prompt `cache` holds."""
    from gpt2kit.score import score_tokens_top

    if len(tokens) < 2:
        return [None], [None]
    lps, tops = score_tokens_top(model, tokens[1:], top, eot_token=tokens[0], cache=cache)
    return [None, *lps], [None, *tops]
