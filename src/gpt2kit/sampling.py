"""Sampling: the settings of a generation, the logit warpers and the draw.

Order, as OpenAI's API and sample.py apply them: logit_bias -> repetition penalty (CTRL's, as
transformers) -> presence/frequency penalties (OpenAI's, over the tokens generated so far) ->
temperature -> top-k -> top-p -> one draw per row. temperature 0 is greedy (argmax after the
bias and the penalties). Each row draws from its own ``torch.Generator`` seeded from
(seed, prompt ids, sample index), so a row's tokens do not depend on which other rows share its batch.

:class:`RowSampler` holds one row's state (its generator, the tokens it has seen and generated)
and chooses its next token from the row's logits; the generation scheduler (gpt2kit.generate)
keeps one per row, so rows with different settings can share a batch.

Legend: B rows, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gpt2kit.config import EOT_ID  # <|endoftext|>: the default stop token and the start of unconditional samples
from gpt2kit.validate import check_int, check_number

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
    # OpenAI's penalties, over the row's generated tokens: logit -= count * frequency + (count > 0) * presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias added to its logit (a mapping or (id, bias) pairs; kept as sorted pairs)
    logit_bias: tuple[tuple[int, float], ...] = ()
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
        object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in bias)))
        check_int("max_new_tokens", self.max_new_tokens, ">= 1", lambda v: v >= 1)
        check_number("temperature", self.temperature, ">= 0 (0 = greedy)", lambda v: v >= 0)
        check_int("top_k", self.top_k, ">= 0 (0 = off)", lambda v: v >= 0)
        check_number("top_p", self.top_p, "in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        if self.top_p_mode not in TOP_P_MODES:
            raise ValueError(f"top_p_mode must be one of {', '.join(TOP_P_MODES)}, got {self.top_p_mode!r}")
        check_number("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)", lambda v: v > 0)
        check_number("presence_penalty", self.presence_penalty, "(0 = off)", lambda v: True)
        check_number("frequency_penalty", self.frequency_penalty, "(0 = off)", lambda v: True)
        for t, b in self.logit_bias:
            check_int("logit_bias token id", t, ">= 0", lambda v: v >= 0)
            check_number(f"logit_bias[{t}]", b, "(finite)", lambda v: True)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first: the argmax of the raw logits."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.logit_bias
                and self.presence_penalty == 0 and self.frequency_penalty == 0)


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
         counts: torch.Tensor | None = None, bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits (B, V) after the bias, the penalties, temperature, top-k and top-p, in that order.
    seen (B, V) bool: tokens in the row (prompt included); counts (B, V): generated tokens; bias:
    bias_tensors(settings) made once (RowSampler does), else made here from settings.logit_bias."""
    logits = logits.float()
    if settings.logit_bias:
        ids, values = bias if bias is not None else bias_tensors(settings, logits.device)
        logits = logits.index_add(-1, ids, values.expand(logits.shape[0], -1))
    if seen is not None and settings.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
    if counts is not None and (settings.presence_penalty or settings.frequency_penalty):
        logits = apply_presence_frequency(logits, counts, settings.presence_penalty, settings.frequency_penalty)
    if settings.greedy:
        return logits  # temperature 0: argmax; top-k and top-p never remove the argmax
    if settings.temperature != 1.0:
        logits = apply_temperature(logits, settings.temperature)
    if settings.top_k > 0:
        logits = top_k_filter(logits, settings.top_k)
    if settings.top_p < 1.0:
        logits = top_p_filter(logits, settings.top_p, settings.top_p_mode)
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


class RowSampler:
    """One row's sampling state: its settings, its generator and the token sets its penalties need.

    choose(logits (1, V)) -> the row's next token; observe(token) after each token the row adds.
    """

    def __init__(self, settings: SamplingSettings, prompt: Sequence[int], n_vocab: int,
                 seed: int | None, sample_index: int = 0, device: torch.device | str = "cpu") -> None:
        self.settings = settings
        self.generator = None if settings.greedy else row_generator(seed, sample_index, device, prompt)
        self.seen = self.counts = None
        if settings.repetition_penalty != 1.0:
            self.seen = torch.zeros(1, n_vocab, dtype=torch.bool, device=device)  # (1, V)
            self.seen[0, list(prompt)] = True
        if settings.presence_penalty or settings.frequency_penalty:
            self.counts = torch.zeros(1, n_vocab, dtype=torch.float32, device=device)  # (1, V)
        bad = [t for t, _ in settings.logit_bias if t >= n_vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        # Made once per row, not per token: the settings are frozen.
        self.plain_greedy = settings.plain_greedy  # argmax of the raw logits (the scheduler batches these)
        self._bias = bias_tensors(settings, device)
        self._generators = None if settings.greedy else [self.generator]

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token (1,) from the row's raw logits (1, V)."""
        if self.plain_greedy:
            return logits.argmax(dim=-1)  # no float32 copy: the conversion is exact, the argmax the same
        return sample(warp(logits, self.settings, self.seen, self.counts, self._bias), self._generators)

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen[0, token] = True
        if self.counts is not None:
            self.counts[0, token] += 1
