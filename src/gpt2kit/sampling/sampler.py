"""The sampler: the warpers applied in order, the draw, :class:`RowSampler` (one row's state) and
:func:`next_tokens` (a batch's rows, each with its own sampler).

What the settings mean and in which order they apply is gpt2kit.sampling's docstring; this module
holds the torch half (gpt2kit.sampling stays torch-free so `gpt2kit generate --help` builds its flags
from SamplingSettings without importing torch). Each row draws from its own ``torch.Generator``
seeded from (seed, prompt ids, sample index), so a row's tokens do not depend on which other rows
share its batch; the generation scheduler (gpt2kit.engine) keeps one RowSampler per row.

Legend: B rows, V vocab.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpt2kit.sampling import TOP_P_MODES
from gpt2kit.sampling.warpers import BadWords, NGramIndex, epsilon_filter, eta_filter, min_p_filter, typical_filter

if TYPE_CHECKING:
    from gpt2kit.sampling import SamplingSettings
    from gpt2kit.tokenizer import Tokenizer

# --- warpers (logits (B, V), float32) ---------------------------------------------------------


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty, as transformers' RepetitionPenaltyLogitsProcessor: the logit of every token
    already in the row (seen (B, V) bool) is divided by penalty when positive, multiplied when not."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties: logits - counts * frequency - (counts > 0) * presence, counts (B, V) the
    times each token was generated so far."""
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


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


def bias_tensors(settings: SamplingSettings, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """settings.logit_bias as (ids (N,) long, biases (N,) float32) on device, or None without one."""
    if not settings.logit_bias:
        return None
    ids = torch.tensor([t for t, _ in settings.logit_bias], device=device)
    return ids, torch.tensor([b for _, b in settings.logit_bias], device=device, dtype=torch.float32)


def warp(logits: torch.Tensor, settings: SamplingSettings, seen: torch.Tensor | None = None,
         counts: torch.Tensor | None = None, banned: torch.Tensor | None = None,
         bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits (B, V) after the bias, the penalties, the constraints, temperature, top-k, top-p, min-p,
    typical, epsilon and eta, in that order (the module doc). seen (B, V) bool: tokens in the row
    (prompt included); counts (B, V): generated tokens; banned (B, V) bool: what the constraints
    ban (RowSampler.banned); bias: bias_tensors(settings) made once (RowSampler does), else made
    here from settings.logit_bias."""
    logits = logits.float()
    if settings.logit_bias:
        ids, values = bias if bias is not None else bias_tensors(settings, logits.device)
        logits = logits.index_add(-1, ids, values.expand(logits.shape[0], -1))
    if seen is not None and settings.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
    if counts is not None and (settings.presence_penalty or settings.frequency_penalty):
        logits = apply_presence_frequency(logits, counts, settings.presence_penalty, settings.frequency_penalty)
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    if settings.greedy:
        return logits  # temperature 0: argmax; the truncation warpers never remove the argmax
    if settings.temperature != 1.0:
        logits = apply_temperature(logits, settings.temperature)
    if settings.top_k > 0:
        logits = top_k_filter(logits, settings.top_k)
    if settings.top_p < 1.0:
        logits = top_p_filter(logits, settings.top_p, settings.top_p_mode)
    if settings.min_p > 0:
        logits = min_p_filter(logits, settings.min_p)
    if settings.typical_p < 1.0:
        logits = typical_filter(logits, settings.typical_p)
    if settings.epsilon_cutoff > 0:
        logits = epsilon_filter(logits, settings.epsilon_cutoff)
    if settings.eta_cutoff > 0:
        logits = eta_filter(logits, settings.eta_cutoff)
    return logits


# --- the draw ---------------------------------------------------------------------------------


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """One token per row (B,) from softmax(logits (B, V)); row r draws from generators[r].

    generators None means greedy: the argmax (the first one on ties, as torch and transformers).
    """
    if generators is None:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])


def row_generator(seed: int, sample_index: int, device: torch.device | str = "cpu",
                  prompt: Sequence[int] = ()) -> torch.Generator:
    """The RNG of a row: seeded from (seed, the prompt's ids, sample index) only, so a row samples the
    same tokens whatever else is in its batch and wherever its prompt sits in a list (two rows with
    the same prompt and sample index agree), while different prompts draw different numbers."""
    x = (seed + 0x9E3779B97F4A7C15 * (sample_index + 1)) % 2**64
    for t in prompt:  # fold the prompt in, so "def " and "import " do not share one stream
        x = _splitmix64((x ^ t) % 2**64)
    g = torch.Generator(device=device)
    g.manual_seed(_splitmix64(x))
    return g


def _splitmix64(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % 2**64
    return x ^ (x >> 31)


def resolve_seed(settings: SamplingSettings) -> int | None:
    """The seed a run uses: settings.seed, or (sampling without one) a draw from torch's global RNG."""
    if settings.seed is None and not settings.greedy:
        return int(torch.randint(0, 2**62, ()).item())
    return settings.seed


def check_finite(logits: torch.Tensor, settings: SamplingSettings) -> None:
    """ValueError unless one row's logits (1, V) can be drawn from: its max is NaN if any logit is,
    +inf breaks the softmax, -inf means no token is left."""
    if not torch.isfinite(logits.amax()):
        raise ValueError(f"the sampling distribution is not finite (NaN, +inf or no token left) with "
                         f"temperature={settings.temperature}, repetition_penalty={settings.repetition_penalty}: "
                         f"the model's logits are not finite, or the settings overflow them")


class RowSampler:
    """One row's sampling state: its settings, its generator, the token sets its penalties need and
    what its constraints need (its sequence, prompt included; its n-grams; its generated count).

    choose(logits (1, V)) -> the row's next token; observe(token) after each token the row adds.
    """

    def __init__(self, settings: SamplingSettings, prompt: Sequence[int], n_vocab: int,
                 seed: int | None, sample_index: int = 0, device: torch.device | str = "cpu",
                 tokenizer: Tokenizer | None = None) -> None:
        self.settings, self.n_vocab, self.device = settings, n_vocab, device
        self.generator = None if settings.greedy else row_generator(seed, sample_index, device, prompt)
        self.seen = self.counts = None
        if settings.repetition_penalty != 1.0:
            self.seen = torch.zeros(1, n_vocab, dtype=torch.bool, device=device)  # (1, V)
            self.seen[0, list(prompt)] = True
        if settings.presence_penalty or settings.frequency_penalty:
            self.counts = torch.zeros(1, n_vocab, dtype=torch.float32, device=device)  # (1, V)
        for name, ids in (("logit_bias", [t for t, _ in settings.logit_bias]),
                          ("suppress_tokens", settings.suppress_tokens),
                          ("bad_words", [t for w in settings.bad_words for t in w])):
            bad = [t for t in ids if t >= n_vocab]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        self.n_generated = 0
        self._init_constraints(settings, prompt, n_vocab, device)
        self.structured = None  # the row's grammar matcher (gpt2kit.sampling.structured)
        if settings.structured is not None:
            from gpt2kit.sampling.structured import matcher_factory

            self.structured = matcher_factory(tokenizer).matcher(settings.structured, n_vocab, settings.stop_token_ids)
        # Made once per row, not per token: the settings are frozen.
        self.plain_greedy = settings.plain_greedy  # argmax of the raw logits (the scheduler batches these)
        self._bias = bias_tensors(settings, device)
        self._generators = None if settings.greedy else [self.generator]

    def _init_constraints(self, s: SamplingSettings, prompt: Sequence[int], n_vocab: int, device) -> None:
        self.bad_words = BadWords(s.bad_words, s.stop_token_ids) if s.bad_words else None
        self.ngrams = NGramIndex(s.no_repeat_ngram_size, prompt) if s.no_repeat_ngram_size else None
        needs_seq = self.ngrams is not None or (self.bad_words is not None and self.bad_words.prefixed)
        self.sequence = list(prompt) if needs_seq else None
        self.always = None  # (1, V) bool: the tokens banned at every step
        fixed = list(s.suppress_tokens) + (self.bad_words.always if self.bad_words else [])
        if fixed:
            self.always = torch.zeros(1, n_vocab, dtype=torch.bool, device=device)
            self.always[0, fixed] = True
        self.stops = [t for t in s.stop_token_ids if t < n_vocab] if s.min_new_tokens else []

    def banned(self) -> torch.Tensor | None:
        """(1, V) bool: the tokens the constraints ban at this step, or None (nothing banned)."""
        ids: list[int] = []
        if self.ngrams is not None:
            ids.extend(self.ngrams.banned(self.sequence))
        if self.bad_words is not None and self.bad_words.prefixed:
            ids.extend(self.bad_words.banned(self.sequence))
        if self.n_generated < self.settings.min_new_tokens:
            ids.extend(self.stops)
        grammar = self.structured_disallowed()
        if not ids and grammar is None:
            return self.always
        if not ids and self.always is None:
            return grammar
        mask = self.always.clone() if self.always is not None else torch.zeros(
            1, self.n_vocab, dtype=torch.bool, device=self.device)
        mask[0, ids] = True
        return mask if grammar is None else mask | grammar

    def structured_disallowed(self) -> torch.Tensor | None:
        """(1, V) bool: the tokens the row's structured-output constraint bans now, or None."""
        if self.structured is None:
            return None
        mask = self.structured.disallowed()
        return None if mask is None else mask.to(self.device)

    @property
    def done(self) -> bool:
        """The row's structured output is complete: nothing but its end can follow."""
        return self.structured is not None and self.structured.done

    def fork(self) -> RowSampler:
        """A copy whose observe() leaves this one alone (what the row would see after tokens it may
        not keep: speculative decoding's drafts); it shares the generator."""
        other = copy.copy(self)
        other.seen = None if self.seen is None else self.seen.clone()
        other.counts = None if self.counts is None else self.counts.clone()
        other.sequence = None if self.sequence is None else list(self.sequence)
        other.ngrams = copy.deepcopy(self.ngrams)
        other.structured = None if self.structured is None else self.structured.fork()
        return other

    def warped(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's raw logits (1, V) after every setting (float32): what choose draws from."""
        return warp(logits, self.settings, self.seen, self.counts, self.banned(), self._bias)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token (1,) from the row's raw logits (1, V)."""
        s = self.settings
        if self.plain_greedy:
            check_finite(logits, s)
            return logits.argmax(dim=-1)  # no float32 copy: the conversion is exact, the argmax the same
        warped = self.warped(logits)
        check_finite(warped, s)
        return sample(warped, self._generators)

    def observe(self, token: int) -> None:
        self.n_generated += 1
        if self.structured is not None:
            self.structured.advance(token)
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[0, token] += 1
        if self.sequence is not None:
            self.sequence.append(token)
            if self.ngrams is not None:
                self.ngrams.observe(self.sequence)


def next_tokens(logits: torch.Tensor, samplers: Sequence[RowSampler],
                failed: dict[int, Exception] | None = None) -> torch.Tensor:
    """Each row's next token (B,): row r chooses from logits[r] (B, V) with samplers[r].

    With failed (a dict), a row whose choice raises is recorded there (row -> exception) and given
    token 0, so one row's failure never costs its neighbours their tokens; without, it raises."""
    if all(s.plain_greedy for s in samplers) and torch.isfinite(logits.amax(dim=-1)).all():
        return logits.argmax(dim=-1)  # one batched argmax: the same as row by row
    out = []  # row by row (RowSampler.choose checks each row's distribution)
    for r, s in enumerate(samplers):
        try:
            out.append(s.choose(logits[r:r + 1]))
        except Exception as e:
            if failed is None:
                raise
            failed[r] = e
            out.append(torch.zeros(1, dtype=torch.long, device=logits.device))
    return torch.cat(out)
