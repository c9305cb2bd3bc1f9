"""Sampling: the settings of a generation, the logit warpers and the draw.

Order, as OpenAI's API and sample.py apply them, with transformers' processors where transformers
puts them (its _get_logits_processor): logit_bias -> repetition penalty (CTRL's, as transformers)
-> presence/frequency penalties (OpenAI's, over the tokens generated so far) -> the constraints
(no repeated n-gram, bad words, min_new_tokens, suppress_tokens; they ban tokens, so their order
among themselves and against the penalties changes nothing) -> temperature -> top-k -> top-p ->
min-p -> typical -> epsilon -> eta -> one draw per row (gpt2kit.warpers computes the new ones as
transformers does). temperature 0 is greedy (argmax after the bias, the penalties and the
constraints; the truncation warpers never remove the argmax, so they are skipped), and so is any
temperature below GREEDY_BELOW (1e-5, as vLLM): dividing by
less could overflow float32, and the distribution there is the argmax to float32 precision anyway.
The other settings are bounded so the warped logits stay finite (repetition_penalty >=
MIN_REPETITION_PENALTY, biases and penalties within +-LOGIT_LIMIT); a row whose warped logits are
still not usable (NaN, +inf, or every token -inf, e.g. from a model with non-finite weights) raises
ValueError for that row alone. Each row draws from its own ``torch.Generator`` seeded from
(seed, prompt ids, sample index), so a row's tokens do not depend on which other rows share its batch.

:class:`RowSampler` holds one row's state (its generator, the tokens it has seen and generated)
and chooses its next token from the row's logits; the generation scheduler (gpt2kit.engine)
keeps one per row, so rows with different settings can share a batch.

Legend: B rows, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gpt2kit.config import EOT_ID  # <|endoftext|>: the default stop token and the start of unconditional samples
from gpt2kit.validate import check_int, check_number
from gpt2kit.warpers import BadWords, NGramIndex, epsilon_filter, eta_filter, min_p_filter, typical_filter

TOP_P_MODES = ("openai", "hf")
GREEDY_BELOW = 1e-5  # temperatures in [0, GREEDY_BELOW) are greedy
MIN_REPETITION_PENALTY = 0.01  # a seen token's logit is scaled by at most 100
LOGIT_LIMIT = 1e9  # |logit_bias value|, |presence_penalty|, |frequency_penalty| at most this
_LOGIT_RANGE = "in [-1e9, 1e9]"


def _within_logit_limit(v: float) -> bool:
    return -LOGIT_LIMIT <= v <= LOGIT_LIMIT


# --- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """What to generate and how. Invalid values raise ValueError naming the value and the limit."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # "openai": keep the tokens whose cumulative probability stays <= top_p (at least one), as
    # OpenAI's sample.py; "hf": also keep the token that crosses top_p, as transformers.
    top_p_mode: str = "openai"
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in the row; >= 0.01
    # OpenAI's penalties, over the row's generated tokens: logit -= count * frequency + (count > 0) * presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias added to its logit (a mapping or (id, bias) pairs, each id once; kept sorted)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # transformers' truncation warpers, after top-p, sampling only
    min_p: float = 0.0  # keep tokens with probability >= min_p x the top token's; in [0, 1]; 0 = off
    typical_p: float = 1.0  # locally typical sampling's mass, in (0, 1]; 1 = off
    epsilon_cutoff: float = 0.0  # drop tokens with probability < epsilon, in [0, 1); 0 = off
    eta_cutoff: float = 0.0  # drop probability < min(eta, sqrt(eta) * exp(-entropy)), in [0, 1); 0 = off
    # transformers' constraints (greedy too): banned tokens
    no_repeat_ngram_size: int = 0  # no n-gram of this size twice in prompt + generated tokens; 0 = off
    # token-id sequences never generated (the last token is banned where the rest precedes it); text
    # becomes such sequences with bad_words_ids(tokenizer, words)
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_new_tokens: int = 0  # the stop tokens are banned until this many tokens were generated
    suppress_tokens: tuple[int, ...] = ()  # token ids never generated
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
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", _check_logit_bias(bias))
        check_int("max_new_tokens", self.max_new_tokens, ">= 1", lambda v: v >= 1)
        self._check_transformers_options()
        check_number("temperature", self.temperature, f">= 0 (below {GREEDY_BELOW:g} = greedy)", lambda v: v >= 0)
        check_int("top_k", self.top_k, ">= 0 (0 = off)", lambda v: v >= 0)
        check_number("top_p", self.top_p, "in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        if self.top_p_mode not in TOP_P_MODES:
            raise ValueError(f"top_p_mode must be one of {', '.join(TOP_P_MODES)}, got {self.top_p_mode!r}")
        check_number("repetition_penalty", self.repetition_penalty, f">= {MIN_REPETITION_PENALTY:g} (1 = off)",
                     lambda v: v >= MIN_REPETITION_PENALTY)
        check_number("presence_penalty", self.presence_penalty, _LOGIT_RANGE + " (0 = off)", _within_logit_limit)
        check_number("frequency_penalty", self.frequency_penalty, _LOGIT_RANGE + " (0 = off)", _within_logit_limit)
        if self.seed is not None:
            check_int("seed", self.seed, "in [0, 2**64)", lambda v: 0 <= v < 2**64)
        for t in self.stop_token_ids:
            check_int("stop_token_ids entry", t, ">= 0", lambda v: v >= 0)
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop_strings entries must be non-empty strings, got {s!r}")
        check_int("num_samples", self.num_samples, ">= 1", lambda v: v >= 1)
        if self.window is not None:
            check_int("window", self.window, ">= 1", lambda v: v >= 1)
        if self.pack_weights not in (None, True, False):
            raise ValueError(f"pack_weights must be None (auto), True or False, got {self.pack_weights!r}")

    def _check_transformers_options(self) -> None:
        check_number("min_p", self.min_p, "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        check_number("typical_p", self.typical_p, "in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        check_number("epsilon_cutoff", self.epsilon_cutoff, "in [0, 1) (0 = off)", lambda v: 0 <= v < 1)
        check_number("eta_cutoff", self.eta_cutoff, "in [0, 1) (0 = off)", lambda v: 0 <= v < 1)
        check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, ">= 0 (0 = off)", lambda v: v >= 0)
        check_int("min_new_tokens", self.min_new_tokens, f"in [0, max_new_tokens={self.max_new_tokens}] (0 = off)",
                  lambda v: 0 <= v <= self.max_new_tokens)
        object.__setattr__(self, "bad_words", _check_bad_words(self.bad_words))
        object.__setattr__(self, "suppress_tokens", _check_ids("suppress_tokens", self.suppress_tokens))

    @property
    def constrained(self) -> bool:
        """Whether a constraint can ban tokens (no_repeat_ngram_size, bad_words, min_new_tokens, suppress_tokens)."""
        return bool(self.no_repeat_ngram_size or self.bad_words or self.min_new_tokens or self.suppress_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first: the argmax of the raw logits."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.logit_bias
                and self.presence_penalty == 0 and self.frequency_penalty == 0 and not self.constrained)


def _check_ids(name: str, ids) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"{name} must be a sequence of token ids, got {ids!r}")
    for t in ids:
        check_int(f"{name} entry", t, ">= 0", lambda v: v >= 0)
    return tuple(ids)


def _check_bad_words(words) -> tuple[tuple[int, ...], ...]:
    """Each entry a non-empty sequence of token ids >= 0 (text goes through bad_words_ids)."""
    if isinstance(words, (str, bytes)) or not isinstance(words, Sequence):
        raise ValueError(f"bad_words must be a sequence of token-id sequences, got {words!r}")
    out = []
    for i, w in enumerate(words):
        if isinstance(w, (str, bytes)):
            raise ValueError(f"bad_words entry {i} must be a sequence of token ids, got the text {w!r}: "
                             f"tokenize it with gpt2kit.sampling.bad_words_ids(tokenizer, words)")
        if not isinstance(w, Sequence) or len(w) == 0:
            raise ValueError(f"bad_words entry {i} must be a non-empty sequence of token ids, got {w!r}")
        out.append(_check_ids(f"bad_words entry {i}", w))
    return tuple(out)


def bad_words_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of words for SamplingSettings.bad_words, as vLLM tokenizes its bad_words:
    each word with its leading spaces stripped, and with one leading space (GPT-2's tokens differ
    mid-text) where that gives as many tokens and another first token."""
    out = []
    for w in words:
        if not isinstance(w, str) or not w.strip():
            raise ValueError(f"bad_words entries must be non-empty text, got {w!r}")
        bare = tokenizer.encode(w.lstrip())
        spaced = tokenizer.encode(" " + w.lstrip())
        out.append(tuple(bare))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(tuple(spaced))
    return tuple(out)


def _check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs, sorted: each id an int >= 0 named once (so 5 and 5 never silently add up),
    each bias finite and within LOGIT_LIMIT."""
    pairs, seen = [], set()
    for pair in bias:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {pair!r}")
        t, b = pair
        check_int("logit_bias token id", t, ">= 0", lambda v: v >= 0)
        check_number(f"logit_bias[{t}]", b, _LOGIT_RANGE, _within_logit_limit)
        if t in seen:
            raise ValueError(f"logit_bias names token id {t} more than once")
        seen.add(t)
        pairs.append((t, b))
    return tuple(sorted(pairs))


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
                 seed: int | None, sample_index: int = 0, device: torch.device | str = "cpu") -> None:
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
        if not ids:
            return self.always
        mask = self.always.clone() if self.always is not None else torch.zeros(
            1, self.n_vocab, dtype=torch.bool, device=self.device)
        mask[0, ids] = True
        return mask

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
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[0, token] += 1
        if self.sequence is not None:
            self.sequence.append(token)
            if self.ngrams is not None:
                self.ngrams.observe(self.sequence)
