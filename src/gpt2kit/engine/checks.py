"""The one check of a request's decoding settings against the model that runs them: what
SamplingSettings cannot know alone (the vocabulary, the context, a tokenizer, what the decoding
method needs of the context). gpt2kit.generation (and the CLI through it) calls it over every
prompt before anything runs, the server (gpt2kit.serve.completions) before it submits a request
(a ValueError there is a 400 naming the field), and the engine's row makers for their one prompt.
A refusal is one ValueError naming the value and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpt2kit.sampling import check_deterministic

if TYPE_CHECKING:
    from gpt2kit.sampling import SamplingSettings


def check_request(prompt_lens: Sequence[int], settings: SamplingSettings, *, n_ctx: int, n_vocab: int,
                  tokenizer: bool, method: str | None = None, draft_model: bool = False) -> None:
    """ValueError unless prompts of these lengths (prompt i: prompt_lens[i] tokens) can be decoded
    with settings by a model of n_ctx positions and n_vocab tokens. tokenizer: whether the text is
    decoded (stop strings need it). method: the decoding method's name, when the caller chose
    beam search without settings saying so (a beam width of 1: the same refusals as any beam
    search); by default the settings' own (beam search for num_beams > 1, contrastive search).
    draft_model: decoding is speculative with a draft model (settings.prompt_lookup: by prompt lookup)."""
    bad_stop = [t for t in settings.stop_token_ids if t >= n_vocab]
    if bad_stop:
        raise ValueError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {n_vocab})")
    window = settings.window_for(n_ctx)
    if window >= n_ctx:
        raise ValueError(f"window must be below the context n_ctx={n_ctx}, got {window}")
    if (settings.stop_strings or settings.structured) and not tokenizer:
        what = "stop_strings need" if settings.stop_strings else "structured outputs need"
        raise ValueError(f"{what} a tokenizer: pass tokenizer=...")
    searched = "contrastive search" if settings.contrastive else "beam search" if settings.num_beams > 1 else None
    if method is not None and searched is None:
        check_deterministic(settings, method)
    method = method or searched
    if method is not None:
        _check_whole_sequence(prompt_lens, settings.max_new_tokens, n_ctx, method, 0)
    if settings.strict:
        _check_fits(prompt_lens, settings.max_new_tokens, n_ctx)
    if draft_model and settings.prompt_lookup:
        raise ValueError(f"draft from a draft model or by prompt lookup (prompt_lookup={settings.prompt_lookup}), "
                         f"not both")
    if method is None and (draft_model or settings.prompt_lookup):
        k = settings.draft_tokens if draft_model else settings.prompt_lookup
        _check_whole_sequence(prompt_lens, settings.max_new_tokens, n_ctx, "speculative decoding", k)


def _check_whole_sequence(prompt_lens: Sequence[int], max_new_tokens: int, n_ctx: int, method: str,
                          drafts: int) -> None:
    """Beam, contrastive and speculative decoding keep the whole sequence in the context (and the
    drafts of a step: speculative decoding's)."""
    for i, n in enumerate(prompt_lens):
        if n + max_new_tokens + drafts > n_ctx:
            more = f" + {drafts} draft tokens" if drafts else ""
            raise ValueError(f"prompt {i}: {method} keeps the whole sequence in the context, so prompt ({n} tokens) + "
                             f"max_new_tokens={max_new_tokens}{more} must be at most n_ctx={n_ctx}")


def _check_fits(prompt_lens: Sequence[int], max_new_tokens: int, n_ctx: int) -> None:
    for i, n in enumerate(prompt_lens):
        # The last new token is sampled, never fed, so it needs no position.
        if n + max_new_tokens - 1 > n_ctx:
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{n + max_new_tokens - 1} positions, more than the context n_ctx={n_ctx} (strict mode)")
