"""The generator API: :func:`generate_stream`, :func:`generate` and :func:`stream_text` (the CLI's
and notebooks'), all on the one engine (gpt2kit.engine, which the server drives through its
EngineLoop). :func:`generate_stream` checks every argument, submits all its rows at step 0
(batch_size of them running at once) and yields one :class:`Step` per iteration; a row that
finishes makes room for the next at the following step.

Past the context the engine cuts a row to its most recent ``window`` tokens (gpt2kit.engine.scheduler);
with ``strict=True``, a prompt + max_new_tokens that would not fit raises ValueError before
anything runs. Settings live in gpt2kit.sampling; warpers and the draw in gpt2kit.sampling.sampler.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpt2kit.config import EOT_ID
from gpt2kit.engine import Engine, EngineInterface, RowKey
from gpt2kit.engine.beam import Beam
from gpt2kit.engine.checks import check_request
from gpt2kit.engine.scheduler import columns_needed
from gpt2kit.engine.speculate import Proposer
from gpt2kit.sampling import SamplingSettings
from gpt2kit.sampling.sampler import resolve_seed
from gpt2kit.validate import check_int

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.prefix_cache import PrefixCache
    from gpt2kit.tokenizer import Tokenizer


@dataclass(frozen=True)
class Step:
    """One decode step. Keys are sequence indices: prompt_index * num_samples + sample_index."""

    tokens: dict[int, int]  # every live row's new token id
    text: dict[int, str]  # with a tokenizer: the text each row's token completed ('' when none)
    finished: dict[int, str]  # rows that ended at this step -> "stop" | "length"
    # speculative decoding: rows that ended at this step -> (draft tokens proposed, draft tokens kept)
    drafts: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class Completion:
    """A finished sample. tokens holds every sampled id, a stop token included; text (with a
    tokenizer) is their text up to, not including, the stop token or stop string."""

    index: int
    prompt_index: int
    sample_index: int
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    score: float | None = None  # beam search: the beam's score (log-probs / length ** length_penalty)
    drafted: int | None = None  # speculative decoding: draft tokens proposed, and kept by the target
    accepted: int | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (speculative decoding; None without it or with nothing drafted)."""
        return self.accepted / self.drafted if self.drafted else None


MAX_ROWS = 65536  # rows (prompts x samples) of one generate call


def generate_stream(model: GPT2, prompts: Sequence[Sequence[int]], settings: SamplingSettings | None = None,
                    *, tokenizer: Tokenizer | None = None, batch_size: int | None = None,
                    draft_model: GPT2 | None = None, interventions=None,
                    prefix_cache: PrefixCache | None = None) -> Iterator[Step]:
    """Generate for token-id prompts, yielding one :class:`Step` per decode step.

    Rows are the prompts x settings.num_samples (sequence index prompt_index * num_samples +
    sample_index), at most batch_size running at once (default: all); a row that finishes makes
    room for the next at the following step. With a tokenizer, each step also carries the new
    text of each row and stop_strings apply. Bad arguments raise ValueError here, before the
    first step. With draft_model (or settings.prompt_lookup), decoding is speculative
    (gpt2kit.engine.speculate): a step may give a row several tokens, yielded as consecutive Steps.
    interventions: the trace's ablations, steering vectors, replacements and SAE clamps
    (gpt2kit.trace: ablate, steer, replace, clamp), applied at every forward to every row: a list
    (every position), or gpt2kit.trace.Interventions(items, on="prompt" | "generated" | "both").
    With prefix_cache (gpt2kit.prefix_cache.PrefixCache, kept by the caller across calls), a prompt
    starts from the keys and values of whole 16-token blocks an earlier prompt with the same start
    left there, and leaves its own (the same tokens, the log-probs within float rounding); not with
    speculative decoding.
    """
    settings = settings or SamplingSettings()
    if settings.num_beams > 1:
        raise ValueError(f"streaming is not defined for beam search (num_beams={settings.num_beams}): the best "
                         f"beam is known only at the end; call generate()")
    if settings.contrastive:
        raise ValueError("contrastive search (penalty_alpha > 0) runs through generate(), not streamed")
    engine, _ = _start(model, prompts, settings, tokenizer, batch_size, draft_model, interventions=interventions,
                       prefix_cache=prefix_cache)
    return _stream(model, engine)


def _start(model: GPT2, prompts: Sequence[Sequence[int]], settings: SamplingSettings, tokenizer: Tokenizer | None,
           batch_size: int | None, draft_model: GPT2 | None = None, interventions=None,
           prefix_cache: PrefixCache | None = None) -> tuple[EngineInterface, list[list[int]]]:
    """Check every argument, then an engine holding all the rows; also the prompts as id lists."""
    cfg = model.config
    prompts = _check_call(prompts, settings, model, tokenizer, batch_size, draft_model)
    edits = _edits(model, interventions, speculative=draft_model is not None or bool(settings.prompt_lookup))
    n = settings.num_samples
    if len(prompts) * n > MAX_ROWS:
        raise ValueError(f"{len(prompts)} prompt(s) x num_samples={n} = {len(prompts) * n} rows; at most "
                         f"{MAX_ROWS} per call (each row's state is made up front): call again for more")
    proposer = None
    if draft_model is not None or settings.prompt_lookup:  # every row speculates (gpt2kit.engine.speculate)
        if prefix_cache is not None:
            raise ValueError("prefix_cache is not used by speculative decoding (draft_model, prompt_lookup)")
        proposer = Proposer(draft_model)
    # slots: as many as run at once, each as long as the longest row gets (engine.batch_cache), and a
    # step's drafts past it when speculating
    rows = len(prompts) * n
    max_len = max(columns_needed(len(p), settings.max_new_tokens, cfg.n_ctx) for p in prompts)
    max_len = min(cfg.n_ctx, max_len + (proposer.tokens(settings) if proposer is not None else 0))
    engine = Engine(model, tokenizer, max_batch=min(batch_size or rows, rows), pack_weights=settings.pack_weights,
                    max_len=max_len, prefix_cache=prefix_cache, proposer=proposer)
    seed = resolve_seed(settings)
    engine.submit([engine.new_row(p, settings, seed=seed, sample_index=j, key=RowKey(i * n + j, i, j), edits=edits)
                   for i, p in enumerate(prompts) for j in range(n)])
    return engine, prompts


def _edits(model: GPT2, interventions, *, speculative: bool):
    """The interventions checked against the model (gpt2kit.trace.steering.prepare), or None."""
    if not interventions:
        return None
    if speculative:
        raise ValueError("interventions apply to plain decoding, not speculative decoding (a draft model or "
                         "prompt_lookup)")
    from gpt2kit.trace.steering import prepare  # the trace wing loads only for a call that intervenes

    return prepare(model, interventions)


def _check_call(prompts: Sequence[Sequence[int]], settings: SamplingSettings, model: GPT2, tokenizer: Tokenizer | None,
                batch_size: int | None, draft_model: GPT2 | None = None) -> list[list[int]]:
    """What every generate call checks first: the prompts (returned as id lists), batch_size, and
    the settings against the model (gpt2kit.engine.checks, the one check the server makes too)."""
    prompts = _check_prompts(prompts, model.config.n_vocab)
    if batch_size is not None:
        check_int("batch_size", batch_size, ">= 1", lambda v: v >= 1)
    check_request([len(p) for p in prompts], settings, n_ctx=model.config.n_ctx, n_vocab=model.config.n_vocab,
                  tokenizer=tokenizer is not None, draft_model=draft_model is not None)
    return prompts


def _stream(model: GPT2, engine: EngineInterface) -> Iterator[Step]:
    was_training = model.training
    model.eval()  # dropout off while generating; restored when the iterator ends or is closed
    try:
        while engine.has_work:
            events = engine.step()
            failed = next((e for e in events if e.error is not None), None)
            if failed is not None:  # the caller asked for every row: no silent gaps
                raise failed.error
            for evs in _rounds(events):
                yield Step({e.row.key.index: e.token for e in evs},
                           {e.row.key.index: e.text for e in evs if e.row.text is not None},
                           {e.row.key.index: e.finish_reason for e in evs if e.finish_reason},
                           {e.row.key.index: (e.row.drafted, e.row.accepted) for e in evs
                            if e.finish_reason and e.row.drafted})
    finally:
        model.train(was_training)


def _rounds(events: list) -> list[list]:
    """A step's events as rounds of at most one event per row (a speculative step gives a row several)."""
    rounds, n = [], {}
    for e in events:
        k = n.get(id(e.row), 0)
        n[id(e.row)] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(e)
    return rounds


def _check_prompts(prompts: Sequence[Sequence[int]], n_vocab: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = prompts.tolist()  # (B, T) of ids
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise ValueError(f"prompt {i} is empty; unconditional samples start from [{EOT_ID}] (<|endoftext|>)")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise ValueError(f"prompt {i} has token id {t!r}, outside the vocabulary [0, {n_vocab})")
        out.append(ids)
    return out


def encode_prompts(tokenizer: Tokenizer, texts: str | Sequence[str]) -> list[list[int]]:
    """Token ids of text prompts; an empty prompt starts from <|endoftext|> (unconditional)."""
    if isinstance(texts, str):
        texts = [texts]
    return [tokenizer.encode(t) if t else [tokenizer.eot_token] for t in texts]


def generate(model: GPT2, prompts: str | Sequence[str] | Sequence[Sequence[int]],
             settings: SamplingSettings | None = None, *, tokenizer: Tokenizer | None = None,
             batch_size: int | None = None, draft_model: GPT2 | None = None, interventions=None,
             prefix_cache: PrefixCache | None = None) -> list[Completion]:
    """Run :func:`generate_stream` to the end; one Completion per row, in sequence-index order.
    prefix_cache: as generate_stream's (not with beam or contrastive search).

    prompts: token-id lists, or text (one string or a list; needs the tokenizer).
    """
    settings = settings or SamplingSettings()
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and all(isinstance(p, str) for p in prompts)):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer: pass tokenizer=...")
        prompts = encode_prompts(tokenizer, prompts)
    if settings.num_beams > 1 or settings.contrastive:
        if interventions:
            raise ValueError("interventions apply to sampled or greedy generation, not beam or contrastive search")
        if prefix_cache is not None:
            raise ValueError("prefix_cache is not used by beam or contrastive search")
        return _beam_completions(model, prompts, settings, tokenizer, batch_size)
    engine, prompts = _start(model, prompts, settings, tokenizer, batch_size, draft_model,
                             interventions=interventions, prefix_cache=prefix_cache)
    n = settings.num_samples
    out = [Completion(i * n + j, i, j, list(p), text="" if tokenizer else None)
           for i, p in enumerate(prompts) for j in range(n)]
    for step in _stream(model, engine):
        for k, t in step.tokens.items():
            out[k].tokens.append(t)
        for k, piece in step.text.items():
            out[k].text += piece
        for k, reason in step.finished.items():
            out[k].finish_reason = reason
        for k, (drafted, accepted) in step.drafts.items():
            out[k].drafted, out[k].accepted = drafted, accepted
    if draft_model is not None or settings.prompt_lookup:
        for c in out:
            c.drafted, c.accepted = c.drafted or 0, c.accepted or 0
    return out


def _beam_completions(model: GPT2, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
                      tokenizer: Tokenizer | None, batch_size: int | None) -> list[Completion]:
    """Beam search (each prompt's beams a BeamGroup of engine rows, gpt2kit.engine.beam_rows, as
    the server runs them): num_return_sequences Completions per prompt, best first, at most
    batch_size rows (prompts x beams) at once (one prompt's beams at least); or contrastive search
    (gpt2kit.engine.contrastive): one Completion per prompt, one row each, prompts batched alike."""
    prompts = _check_call(prompts, settings, model, tokenizer, batch_size)
    width = 1 if settings.contrastive else settings.num_beams  # cache rows per prompt
    n, per_batch = settings.num_return_sequences, max(1, (batch_size or len(prompts) * width) // width)
    was_training = model.training
    model.eval()
    try:
        found = (_contrastive(model, prompts, settings, per_batch) if settings.contrastive
                 else _engine_beams(model, prompts, settings, per_batch * width))
    finally:
        model.train(was_training)
    return [Completion(i * n + j, i, j, list(prompts[i]), list(b.tokens),
                       b.text(tokenizer) if tokenizer is not None else None, b.finish_reason, score=b.score)
            for i, beams in enumerate(found) for j, b in enumerate(beams)]


def _engine_beams(model: GPT2, prompts: list[list[int]], settings: SamplingSettings, max_batch: int
                  ) -> list[list[Beam]]:
    """Each prompt's returned beams, best first: its beam group on one engine of max_batch rows."""
    max_len = max(columns_needed(len(p), settings.max_new_tokens, model.config.n_ctx) for p in prompts)
    engine = Engine(model, max_batch=max_batch, pack_weights=settings.pack_weights, max_len=max_len)
    for i, p in enumerate(prompts):
        engine.submit(engine.new_beam_rows(p, settings, key=RowKey(i, i, 0)))
    found: dict[int, list[Beam]] = {}
    while engine.has_work:
        for ev in engine.step():
            if ev.error is not None:  # the caller asked for every prompt: no silent gaps
                raise ev.error
            found[ev.row.key.prompt_index] = list(ev.beams)
    return [found[i] for i in range(len(prompts))]


def _contrastive(model: GPT2, prompts: list[list[int]], settings: SamplingSettings, per_batch: int
                 ) -> list[list[Beam]]:
    """Each prompt's contrastive search as one Beam (score None), per_batch prompts at a time."""
    from gpt2kit.engine.contrastive import contrastive_search

    stops = settings.stop_token_ids
    return [[Beam(t, None, "stop" if t and t[-1] in stops else "length")]
            for start in range(0, len(prompts), per_batch)
            for t in contrastive_search(model, prompts[start:start + per_batch], settings)]


def stream_text(model: GPT2, tokenizer: Tokenizer, prompt: str,
                settings: SamplingSettings | None = None, *, interventions=None) -> Iterator[str]:
    """The new text for one prompt (one sample), piece by piece as it is generated; pieces are
    whole characters and concatenate to the completion's text."""
    settings = settings or SamplingSettings()
    if settings.num_samples != 1:
        raise ValueError(f"stream_text generates one sample, got num_samples={settings.num_samples}")
    for step in generate_stream(model, encode_prompts(tokenizer, prompt), settings, tokenizer=tokenizer,
                                interventions=interventions):
        piece = step.text.get(0, "")
        if piece:
            yield piece
