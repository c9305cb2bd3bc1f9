"""Text generation: sampling warpers, the batch scheduler and the generator API (the model steps: gpt2kit.decode).

One iterator, :func:`generate_stream`, serves the CLI, the server and notebooks: token-id prompts
in (one or a batch), one :class:`Step` out per decode step with each live row's new token, its new
text (when a tokenizer is given) and the rows that finished. :func:`generate` collects the steps
into :class:`Completion` objects; :func:`stream_text` yields the text pieces of one prompt.

A run, as gpt-fast does it: rows = prompts x num_samples, left-padded into one batch (positions
come from the attention mask, so a padded row computes what it would alone); one KVCache,
preallocated for prompt + new tokens and written in place; :func:`~gpt2kit.decode.prefill` encodes the prompts
(logits of the last position only); then :func:`~gpt2kit.decode.decode_step` feeds one token per row per
step. Rows that finish are dropped from the batch (``KVCache.select``) and stop costing work.

Sampling follows OpenAI's sample.py order: repetition penalty (CTRL's, as transformers applies it)
-> temperature -> top-k -> top-p -> one draw per row. temperature 0 is greedy (argmax, after the
repetition penalty). Each row draws from its own ``torch.Generator`` seeded from
(seed, sample index), so a row's tokens do not depend on which other rows share its batch.

Past the context (GPT-2 has learned positions 0..n_ctx-1, so the cache cannot simply slide): the
model sees at most n_ctx tokens of a row. When a row's sequence (a prompt, or prompt + generated
tokens) would exceed n_ctx, its context is cut to its most recent ``window`` tokens (default
n_ctx // 2) and re-encoded in one prefill; decoding then goes on with the cache until the context
fills again. With ``strict=True``, a prompt + max_new_tokens that would not fit raises ValueError
before anything runs.

Legend: B rows in the batch, T (padded) context length, P cached length, M cache size, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpt2kit.decode import decode_step, kernels_for, prefill
from gpt2kit.kv_cache import KVCache

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer

EOT_ID = 50256  # <|endoftext|>: the default stop token and the start of unconditional samples
TOP_P_MODES = ("openai", "hf")


# --- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """What to generate and how. Invalid values raise ValueError naming the value and the limit."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # "openai": keep the tokens whose cumulative probability stays <= top_p (at least one), as
    # OpenAI's sample.py; "hf": also keep the token that crosses top_p, as transformers.
    top_p_mode: str = "openai"
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in the row
    seed: int | None = None  # None: drawn from torch's global RNG (so torch.manual_seed applies)
    stop_token_ids: tuple[int, ...] = (EOT_ID,)
    stop_strings: tuple[str, ...] = ()  # need a tokenizer; the text is cut before the stop string
    num_samples: int = 1  # rows per prompt
    strict: bool = False  # past n_ctx: raise up front instead of re-encoding a window
    window: int | None = None  # tokens kept when re-encoding past n_ctx; None = n_ctx // 2
    # CPU decode steps with oneDNN-prepacked copies of the weight matrices (gpt2kit.decode.packed: faster,
    # a second copy of them in memory); None = where it is faster and the copy fits, True/False.
    pack_weights: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        _check_int("max_new_tokens", self.max_new_tokens, ">= 1", lambda v: v >= 1)
        _check_float("temperature", self.temperature, ">= 0 (0 = greedy)", lambda v: v >= 0)
        _check_int("top_k", self.top_k, ">= 0 (0 = off)", lambda v: v >= 0)
        _check_float("top_p", self.top_p, "in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        if self.top_p_mode not in TOP_P_MODES:
            raise ValueError(f"top_p_mode must be one of {', '.join(TOP_P_MODES)}, got {self.top_p_mode!r}")
        _check_float("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)", lambda v: v > 0)
        if self.seed is not None:
            _check_int("seed", self.seed, ">= 0", lambda v: v >= 0)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, ">= 0", lambda v: v >= 0)
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop_strings entries must be non-empty strings, got {s!r}")
        _check_int("num_samples", self.num_samples, ">= 1", lambda v: v >= 1)
        if self.window is not None:
            _check_int("window", self.window, ">= 1", lambda v: v >= 1)
        if self.pack_weights not in (None, True, False):
            raise ValueError(f"pack_weights must be None (auto), True or False, got {self.pack_weights!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object, limit: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"{name} must be an integer {limit}, got {value!r}")


def _check_float(name: str, value: object, limit: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not ok(value):
        raise ValueError(f"{name} must be a number {limit}, got {value!r}")


# --- warpers and sampling (logits (B, V), float32) --------------------------------------------


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty, as transformers' RepetitionPenaltyLogitsProcessor: the logit of every token
    already in the row (seen (B, V) bool) is divided by penalty when positive, multiplied when not."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); the rest become -inf."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float, mode: str = "openai") -> torch.Tensor:
    """Nucleus filtering; the tokens outside the nucleus become -inf.

    mode "openai" (sample.py's top_p_logits): keep the most probable tokens while their cumulative
    probability is <= p, at least one (ties with the last kept logit are kept too).
    mode "hf" (transformers' TopPLogitsWarper): keep the smallest set whose probability reaches p,
    i.e. also the token that crosses p.
    """
    if mode == "openai":
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # (B, V)
        cum = sorted_logits.softmax(-1).cumsum(-1)  # (B, V)
        n_keep = (cum <= p).sum(-1, keepdim=True).clamp_(min=1)  # (B, 1)
        threshold = sorted_logits.gather(-1, n_keep - 1)  # (B, 1)
        return logits.masked_fill(logits < threshold, float("-inf"))
    if mode == "hf":
        # transformers' own formulation (ascending sort), so the two agree to the last bit.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)  # (B, V)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - p)
        remove_sorted[..., -1] = False  # the most probable token always stays
        remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocab order
        return logits.masked_fill(remove, float("-inf"))
    raise ValueError(f"top_p mode must be one of {', '.join(TOP_P_MODES)}, got {mode!r}")


def warp(logits: torch.Tensor, settings: SamplingSettings, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, V) after the repetition penalty, temperature, top-k and top-p, in that order."""
    logits = logits.float()
    if seen is not None and settings.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
    if settings.greedy:
        return logits  # temperature 0: argmax; top-k and top-p never remove the argmax
    if settings.temperature != 1.0:
        logits = apply_temperature(logits, settings.temperature)
    if settings.top_k > 0:
        logits = top_k_filter(logits, settings.top_k)
    if settings.top_p < 1.0:
        logits = top_p_filter(logits, settings.top_p, settings.top_p_mode)
    return logits


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """One token per row (B,) from softmax(logits (B, V)); row r draws from generators[r].

    generators None means greedy: the argmax (the first one on ties, as torch and transformers).
    """
    if generators is None:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])


def row_generator(seed: int, sample_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The RNG of a row: seeded from (seed, sample index) only, so a row samples the same tokens
    whatever else is in its batch (two rows with the same prompt and sample index agree)."""
    g = torch.Generator(device=device)
    g.manual_seed(_splitmix64((seed + 0x9E3779B97F4A7C15 * (sample_index + 1)) % 2**64))
    return g


def _splitmix64(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % 2**64
    return x ^ (x >> 31)


# --- sampling a step ------------------------------------------------------------------------


@torch.inference_mode()
def next_tokens(logits: torch.Tensor, settings: SamplingSettings, seen: torch.Tensor | None,
                generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """Warp and sample: logits (B, V) -> token ids (B,)."""
    if settings.greedy and settings.repetition_penalty == 1.0:
        return logits.argmax(dim=-1)  # no float32 copy: the conversion is exact, the argmax the same
    return sample(warp(logits, settings, seen), None if settings.greedy else generators)


# --- the generator API ------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One decode step. Keys are sequence indices: prompt_index * num_samples + sample_index."""

    tokens: dict[int, int]  # every live row's new token id
    text: dict[int, str]  # with a tokenizer: the text each row's token completed ('' when none)
    finished: dict[int, str]  # rows that ended at this step -> "stop" | "length"


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


class _RowText:
    """A row's text: whole UTF-8 characters only, with any tail that could begin a stop string
    held back until it is known not to be one (so no streamed text ever has to be taken back)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.decoder = tokenizer.decoder()
        self.stops = stops
        self.pending = ""

    def feed(self, token: int) -> tuple[str, bool]:
        """(text now safe to emit, whether a stop string was completed)."""
        return self._emit(self.pending + self.decoder.feed([token]), final=False)

    def finish(self) -> str:
        return self._emit(self.pending + self.decoder.flush(), final=True)[0]

    def _emit(self, s: str, *, final: bool) -> tuple[str, bool]:
        cut = min((i for i in (s.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return s[:cut], True
        hold = 0 if final else _prefix_overlap(s, self.stops)
        self.pending = s[len(s) - hold:]
        return s[: len(s) - hold], False


def _prefix_overlap(s: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of s that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(s)), best, -1):
            if s.endswith(stop[:n]):
                best = n
                break
    return best


@dataclass
class _Row:
    index: int
    prompt: list[int]
    generator: torch.Generator | None
    text: _RowText | None
    tokens: list[int] = field(default_factory=list)
    start: int = 0  # the context is (prompt + tokens)[start:]

    def context(self, n_ctx: int, window: int) -> list[int]:
        seq = self.prompt + self.tokens
        if len(seq) - self.start > n_ctx:
            self.start = len(seq) - window
        return seq[self.start:]


def generate_stream(model: GPT2, prompts: Sequence[Sequence[int]], settings: SamplingSettings | None = None,
                    *, tokenizer: Tokenizer | None = None, batch_size: int | None = None) -> Iterator[Step]:
    """Generate for token-id prompts, yielding one :class:`Step` per decode step.

    Rows are the prompts x settings.num_samples (sequence index prompt_index * num_samples +
    sample_index), run batch_size rows at a time (default: all at once). With a tokenizer, each
    step also carries the new text of each row and stop_strings apply. Bad arguments raise
    ValueError here, before the first step.
    """
    settings = settings or SamplingSettings()
    cfg = model.config
    prompts = _check_prompts(prompts, cfg.n_vocab)
    window = settings.window or max(cfg.n_ctx // 2, 1)
    if window >= cfg.n_ctx:
        raise ValueError(f"window must be below the context n_ctx={cfg.n_ctx}, got {window}")
    bad_stop = [t for t in settings.stop_token_ids if t >= cfg.n_vocab]
    if bad_stop:
        raise ValueError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {cfg.n_vocab})")
    if settings.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer: pass tokenizer=...")
    if settings.strict:
        _check_fits(prompts, settings.max_new_tokens, cfg.n_ctx)
    if batch_size is not None:
        _check_int("batch_size", batch_size, ">= 1", lambda v: v >= 1)

    device = model.wte.weight.device
    seed = settings.seed
    if seed is None and not settings.greedy:
        seed = int(torch.randint(0, 2**62, ()).item())
    rows = []
    for i, prompt in enumerate(prompts):
        for j in range(settings.num_samples):
            gen = None if settings.greedy else row_generator(seed, j, device)
            text = _RowText(tokenizer, settings.stop_strings) if tokenizer is not None else None
            rows.append(_Row(i * settings.num_samples + j, list(prompt), gen, text))
    return _stream(model, rows, settings, window, batch_size or len(rows))


def _stream(model: GPT2, rows: list[_Row], settings: SamplingSettings, window: int,
            batch_size: int) -> Iterator[Step]:
    was_training = model.training
    model.eval()  # dropout off while generating; restored when the iterator ends or is closed
    try:
        for start in range(0, len(rows), batch_size):
            yield from _run_batch(model, rows[start:start + batch_size], settings, window)
    finally:
        model.train(was_training)


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


def _check_fits(prompts: list[list[int]], max_new_tokens: int, n_ctx: int) -> None:
    for i, p in enumerate(prompts):
        # The last new token is sampled, never fed, so it needs no position.
        if len(p) + max_new_tokens - 1 > n_ctx:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens - 1} positions, more than the context n_ctx={n_ctx} (strict mode)")


class _Batch:
    """The tensors of the rows in flight: the cache, the padding mask, the seen-token mask."""

    def __init__(self, model: GPT2, rows: list[_Row], settings: SamplingSettings, window: int) -> None:
        self.model, self.settings, self.window = model, settings, window
        self.device = model.wte.weight.device
        self.seen = None  # (B, V) bool: the tokens in each row so far, for the repetition penalty
        if settings.repetition_penalty != 1.0:
            with torch.inference_mode():
                self.seen = torch.zeros(len(rows), model.config.n_vocab, dtype=torch.bool, device=self.device)
                for r, row in enumerate(rows):
                    self.seen[r, row.prompt + row.tokens] = True

    @torch.inference_mode()
    def encode(self, rows: list[_Row]) -> torch.Tensor:
        """(Re)build the cache from each row's context, left-padded; logits (B, V) of its last token."""
        n_ctx = self.model.config.n_ctx
        contexts = [row.context(n_ctx, self.window) for row in rows]
        B, T = len(rows), max(map(len, contexts))
        to_sample = max(self.settings.max_new_tokens - len(row.tokens) for row in rows)
        M = min(n_ctx, T + to_sample - 1)  # the last sampled token is never fed
        idx = torch.full((B, T), EOT_ID % self.model.config.n_vocab, dtype=torch.long)  # (B, T)
        self.mask = torch.ones(B, M, dtype=torch.long)  # (B, M): 1 real, 0 padding
        for r, ctx in enumerate(contexts):
            idx[r, T - len(ctx):] = torch.tensor(ctx)
            self.mask[r, : T - len(ctx)] = 0
        idx, self.mask = idx.to(self.device), self.mask.to(self.device)
        self.padded = any(len(c) < T for c in contexts)
        self.cache = KVCache.for_model(self.model, B, M)
        self.kernels = kernels_for(self.model, B, self.settings.pack_weights)
        return prefill(self.model, idx, self.mask[:, :T] if self.padded else None, self.cache)

    @torch.inference_mode()
    def step(self, rows: list[_Row], tok: torch.Tensor) -> torch.Tensor:
        """Feed the rows' newest tokens tok (B,); logits (B, V) for the next ones."""
        if self.seen is not None:
            self.seen.scatter_(1, tok[:, None], True)
        if self.cache.length == self.cache.max_len:
            return self.encode(rows)  # context full: re-encode the recent window (module doc)
        P = self.cache.length
        mask = self.mask[:, : P + 1] if self.padded else None  # (B, P + 1)
        return decode_step(self.model, tok[:, None], self.cache, mask, self.kernels)

    @torch.inference_mode()
    def keep(self, keep: list[int]) -> None:
        """Drop the finished rows: keep only batch rows `keep`."""
        rows = torch.tensor(keep, device=self.device)
        self.cache.select(rows)
        self.mask = self.mask[rows]
        self.padded = bool((self.mask[:, : self.cache.length] == 0).any())
        if self.seen is not None:
            self.seen = self.seen[rows]


def _run_batch(model: GPT2, rows: list[_Row], settings: SamplingSettings, window: int) -> Iterator[Step]:
    batch = _Batch(model, rows, settings, window)
    logits = batch.encode(rows)
    stops = frozenset(settings.stop_token_ids)
    while True:
        generators = None if settings.greedy else [row.generator for row in rows]
        tok = next_tokens(logits, settings, batch.seen, generators)  # (B,)
        tokens, texts, finished, keep = {}, {}, {}, []
        for r, (row, t) in enumerate(zip(rows, tok.tolist(), strict=True)):
            row.tokens.append(t)
            tokens[row.index] = t
            reason = "stop" if t in stops else None  # a stop token ends the row; not in its text
            piece, hit = "", False
            if row.text is not None and reason is None:
                piece, hit = row.text.feed(t)
                reason = "stop" if hit else None
            if reason is None and len(row.tokens) == settings.max_new_tokens:
                reason = "length"
            if row.text is not None:
                # After a stop string the rest is dropped; otherwise emit what was held back.
                texts[row.index] = piece + (row.text.finish() if reason and not hit else "")
            if reason is None:
                keep.append(r)
            else:
                finished[row.index] = reason
        yield Step(tokens, texts, finished)
        if not keep:
            return
        if len(keep) < len(rows):
            rows = [rows[r] for r in keep]
            batch.keep(keep)
            tok = tok[keep]
        logits = batch.step(rows, tok)


def encode_prompts(tokenizer: Tokenizer, texts: str | Sequence[str]) -> list[list[int]]:
    """Token ids of text prompts; an empty prompt starts from <|endoftext|> (unconditional)."""
    if isinstance(texts, str):
        texts = [texts]
    return [tokenizer.encode(t) if t else [tokenizer.eot_token] for t in texts]


def generate(model: GPT2, prompts: str | Sequence[str] | Sequence[Sequence[int]],
             settings: SamplingSettings | None = None, *, tokenizer: Tokenizer | None = None,
             batch_size: int | None = None) -> list[Completion]:
    """Run :func:`generate_stream` to the end; one Completion per row, in sequence-index order.

    prompts: token-id lists, or text (one string or a list; needs the tokenizer).
    """
    settings = settings or SamplingSettings()
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and all(isinstance(p, str) for p in prompts)):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer: pass tokenizer=...")
        prompts = encode_prompts(tokenizer, prompts)
    prompts = _check_prompts(prompts, model.config.n_vocab)
    n = settings.num_samples
    out = [Completion(i * n + j, i, j, list(p), text="" if tokenizer else None)
           for i, p in enumerate(prompts) for j in range(n)]
    for step in generate_stream(model, prompts, settings, tokenizer=tokenizer, batch_size=batch_size):
        for k, t in step.tokens.items():
            out[k].tokens.append(t)
        for k, piece in step.text.items():
            out[k].text += piece
        for k, reason in step.finished.items():
            out[k].finish_reason = reason
    return out


def stream_text(model: GPT2, tokenizer: Tokenizer, prompt: str,
                settings: SamplingSettings | None = None) -> Iterator[str]:
    """The new text for one prompt (one sample), piece by piece as it is generated; pieces are
    whole characters and concatenate to the completion's text."""
    settings = settings or SamplingSettings()
    if settings.num_samples != 1:
        raise ValueError(f"stream_text generates one sample, got num_samples={settings.num_samples}")
    for step in generate_stream(model, encode_prompts(tokenizer, prompt), settings, tokenizer=tokenizer):
        piece = step.text.get(0, "")
        if piece:
            yield piece
