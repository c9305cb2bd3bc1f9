"""Sampling: the settings of a generation (the warpers and the draw that apply them: gpt2kit.sampling.sampler).

Order, as OpenAI's API and sample.py apply them, with transformers' processors where transformers
puts them (its _get_logits_processor): logit_bias -> repetition penalty (CTRL's, as transformers)
-> presence/frequency penalties (OpenAI's, over the tokens generated so far) -> the constraints
(no repeated n-gram, bad words, min_new_tokens, suppress_tokens; they ban tokens, so their order
among themselves and against the penalties changes nothing) -> temperature -> top-k -> top-p ->
min-p -> typical -> epsilon -> eta -> one draw per row (gpt2kit.sampling.warpers computes the new ones as
transformers does). temperature 0 is greedy (argmax after the bias, the penalties and the
constraints; the truncation warpers never remove the argmax, so they are skipped), and so is any
temperature below GREEDY_BELOW (1e-5, as vLLM): dividing by
less could overflow float32, and the distribution there is the argmax to float32 precision anyway.
The other settings are bounded so the warped logits stay finite (repetition_penalty >=
MIN_REPETITION_PENALTY, biases and penalties within +-LOGIT_LIMIT); a row whose warped logits are
still not usable (NaN, +inf, or every token -inf, e.g. from a model with non-finite weights) raises
ValueError for that row alone. Each row draws from its own ``torch.Generator`` seeded from
(seed, prompt ids, sample index), so a row's tokens do not depend on which other rows share its batch.

The warpers, the draw and :class:`RowSampler` (one row's state) are the torch half, in
gpt2kit.sampling.sampler; this module is torch-free, so `gpt2kit generate` builds its flags from
SamplingSettings' fields (their metadata holds the help) without importing torch.

Legend: B rows, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpt2kit.config import EOT_ID  # <|endoftext|>: the default stop token and the start of unconditional samples
from gpt2kit.sampling.constraint import Constraint
from gpt2kit.validate import SettingError, check_int, check_number

TOP_P_MODES = ("openai", "hf")
GREEDY_BELOW = 1e-5  # temperatures in [0, GREEDY_BELOW) are greedy
MIN_REPETITION_PENALTY = 0.01  # a seen token's logit is scaled by at most 100
MAX_DRAFT_TOKENS = 64  # prompt_lookup and draft_tokens at most this (tokens verified per step)
MAX_BEAMS = 64  # num_beams at most this (rows per prompt)
MAX_PENALTY_EXPONENT = 700.0  # |length_penalty| * ln(max_new_tokens) at most: e**700 = 1e304 (float64 to 1.8e308)
LOGIT_LIMIT = 1e9  # |logit_bias value|, |presence_penalty|, |frequency_penalty| at most this
_LOGIT_RANGE = "in [-1e9, 1e9]"


def _within_logit_limit(v: float) -> bool:
    return -LOGIT_LIMIT <= v <= LOGIT_LIMIT


# --- settings ---------------------------------------------------------------------------------


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """A SamplingSettings field: its default and what `gpt2kit generate` shows (help; optionally short,
    choices, or a flag of another name that stores const), as gpt2kit.train.config's fields."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class SamplingSettings:
    """What to generate and how. Invalid values raise ValueError naming the value and the limit."""

    max_new_tokens: int = _setting(128, "tokens to generate per sample", short="-n")
    temperature: float = _setting(1.0, "0 (or below 1e-5) = greedy (default 1)", short="-t")
    top_k: int = _setting(0, "keep the k most likely tokens (0 = off)")
    top_p: float = _setting(1.0, "nucleus sampling threshold in (0, 1] (1 = off)")
    # "openai": keep the tokens whose cumulative probability stays <= top_p (at least one), as
    # OpenAI's sample.py; "hf": also keep the token that crosses top_p, as transformers.
    top_p_mode: str = _setting("openai", "openai: keep tokens with cumulative prob <= p (sample.py); hf: also the "
                                         "one crossing p", choices=TOP_P_MODES)
    repetition_penalty: float = _setting(1.0, "CTRL's penalty (1 = off; >= 0.01)")
    # OpenAI's penalties, over the row's generated tokens: logit -= count * frequency + (count > 0) * presence
    presence_penalty: float = _setting(0.0, "OpenAI's presence penalty, in [-1e9, 1e9] (0 = off)")
    frequency_penalty: float = _setting(0.0, "OpenAI's frequency penalty, in [-1e9, 1e9] (0 = off)")
    # token id -> bias added to its logit (a mapping or (id, bias) pairs, each id once; kept sorted)
    logit_bias: tuple[tuple[int, float], ...] = _setting((), "token id -> bias added to its logit")
    # transformers' truncation warpers, after top-p, sampling only
    min_p: float = _setting(0.0, "min-p sampling: drop tokens less likely than MIN_P x the top token (0 = off)")
    typical_p: float = _setting(1.0, "locally typical sampling's mass in (0, 1] (1 = off)")
    epsilon_cutoff: float = _setting(0.0, "epsilon sampling: drop tokens less likely than this, in [0, 1) (0 = off)")
    # eta: drop probability < min(eta, sqrt(eta) * exp(-entropy))
    eta_cutoff: float = _setting(0.0, "eta sampling's eta in [0, 1) (0 = off)")
    # transformers' constraints (greedy too): banned tokens
    no_repeat_ngram_size: int = _setting(0, "never repeat an n-gram of this size, the prompt's included (0 = off)")
    # token-id sequences never generated (the last token is banned where the rest precedes it); text
    # becomes such sequences with bad_words_ids(tokenizer, words)
    bad_words: tuple[tuple[int, ...], ...] = _setting((), "token-id sequences never generated")
    min_new_tokens: int = _setting(0, "no stop token before this many new tokens")
    suppress_tokens: tuple[int, ...] = _setting((), "token ids never generated")
    # Structured outputs (gpt2kit.sampling.constraint): a JSON schema, a regex, choices or a grammar the
    # output must match; its mask bans tokens as the constraints above do. The CLI's flags are
    # --json-schema, --regex, --choice and --grammar.
    structured: Constraint | None = _setting(None, "what the output must match (structured outputs)")
    # None: drawn from torch's global RNG (so torch.manual_seed applies)
    seed: int | None = _setting(None, "random seed (same seed, same text; default: none, a different sample each run)")
    stop_token_ids: tuple[int, ...] = _setting((EOT_ID,), "token ids that end a sample")
    # need a tokenizer; the text is cut before the stop string
    stop_strings: tuple[str, ...] = _setting((), "strings that end a sample")
    num_samples: int = _setting(1, "samples per prompt")  # rows per prompt
    strict: bool = _setting(False, "error if prompt + new tokens exceed the context (default: re-encode a recent "
                                   "window)")
    window: int | None = _setting(None, "tokens kept when re-encoding past the context (default n_ctx/2)")
    # CPU decode steps with oneDNN-prepacked copies of the weight matrices (gpt2kit.decode.packed: faster,
    # a second copy of them in memory); None = where it is faster and the copy fits, True/False.
    pack_weights: bool | None = _setting(None, "CPU: no prepacked second copy of the weights (slower decode, less "
                                               "memory)", flag="--no-pack-weights", const=False)
    # Speculative decoding (gpt2kit.engine.drafts, gpt2kit.engine.speculate; the draft model itself is an
    # argument of generate, not a setting)
    prompt_lookup: int = _setting(0, "speculative decoding: draft up to N tokens per step from n-gram matches in "
                                     "the context (0 = off; at most 64)", metavar="N")
    draft_tokens: int = _setting(4, "speculative decoding: tokens --draft-model proposes per step (1 .. 64)",
                                 metavar="K")
    # Beam search (gpt2kit.engine.beam, transformers' meanings): num_beams > 1 turns it on (deterministic:
    # temperature, top-k, top-p and seed do not apply); early_stopping True, False or "never".
    num_beams: int = _setting(1, "beam search with N beams per prompt (1 = off; at most 64; not streamed)",
                              metavar="N")
    length_penalty: float = _setting(1.0, "beam search: a finished beam's score is its log-prob sum / "
                                          "length ** L", metavar="L")
    early_stopping: bool | str = _setting(False, "beam search: true, false or never (transformers' meanings)")
    num_return_sequences: int = _setting(1, "beam search: beams returned per prompt, best first (<= num_beams)",
                                         metavar="N")
    # Contrastive search (gpt2kit.engine.contrastive): penalty_alpha > 0 with top_k > 1 turns it on
    # (deterministic; top_k candidates per step); in [0, 1].
    penalty_alpha: float = _setting(0.0, "contrastive search over --top-k candidates (0 = off; in [0, 1]; not "
                                         "streamed)", metavar="A")

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
        check_int("prompt_lookup", self.prompt_lookup, f"in [0, {MAX_DRAFT_TOKENS}] (0 = off)",
                  lambda v: 0 <= v <= MAX_DRAFT_TOKENS)
        check_int("draft_tokens", self.draft_tokens, f"in [1, {MAX_DRAFT_TOKENS}]",
                  lambda v: 1 <= v <= MAX_DRAFT_TOKENS)
        _check_beams(self)
        check_number("penalty_alpha", self.penalty_alpha, "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        if self.contrastive:
            check_deterministic(self, f"contrastive search (penalty_alpha={self.penalty_alpha})")
            if self.num_beams > 1:
                raise SettingError("contrastive search (penalty_alpha > 0) and beam search (num_beams > 1) are "
                                   "two methods: choose one", "penalty_alpha")

    def window_for(self, n_ctx: int) -> int:
        """Tokens kept when re-encoding past the context n_ctx: window, or n_ctx // 2 (at least 1)."""
        return self.window or max(n_ctx // 2, 1)

    @property
    def contrastive(self) -> bool:
        """Contrastive search: penalty_alpha > 0 and top_k > 1 (transformers' condition)."""
        return self.penalty_alpha > 0 and self.top_k > 1

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
        if self.structured is not None and not isinstance(self.structured, Constraint):
            raise SettingError(f"structured must be a gpt2kit.sampling.Constraint or None, got {self.structured!r}",
                               "structured")

    @property
    def constrained(self) -> bool:
        """Whether a constraint can ban tokens (no_repeat_ngram_size, bad_words, min_new_tokens, suppress_tokens,
        structured)."""
        return bool(self.no_repeat_ngram_size or self.bad_words or self.min_new_tokens or self.suppress_tokens
                    or self.structured)

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


def bad_word_text(word: object, name: str = "bad_words entry") -> str:
    """The text of a bad word that is tokenized: the word with its leading whitespace stripped, as vLLM
    strips it (str.lstrip: Unicode whitespace, NEL and no-break space included). ValueError, the word
    shown escaped, when that leaves nothing to tokenize: a word that is only whitespace bans nothing."""
    if not isinstance(word, str) or not word:
        raise SettingError(f"{name} must be non-empty text, got {word!r}", "bad_words")
    text = word.lstrip()
    if not text:
        raise SettingError(f"{name} {word!r} is only whitespace: a bad word's leading whitespace is stripped "
                           "(as vLLM does), which leaves no text to ban", "bad_words")
    return text


def bad_words_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of words for SamplingSettings.bad_words, as vLLM tokenizes its bad_words:
    each word with its leading spaces stripped, and with one leading space (GPT-2's tokens differ
    mid-text) where that gives as many tokens and another first token."""
    out = []
    for w in words:
        text = bad_word_text(w)
        bare = tokenizer.encode(text)
        spaced = tokenizer.encode(" " + text)
        out.append(tuple(bare))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(tuple(spaced))
    return tuple(out)


def _check_beams(s: SamplingSettings) -> None:
    check_int("num_beams", s.num_beams, f"in [1, {MAX_BEAMS}] (1 = no beam search)", lambda v: 1 <= v <= MAX_BEAMS)
    check_number("length_penalty", s.length_penalty, "in [-100, 100]", lambda v: -100 <= v <= 100)
    if s.num_beams > 1 and s.max_new_tokens > 1:  # a score divides by length ** length_penalty, in float64
        most = MAX_PENALTY_EXPONENT / math.log(s.max_new_tokens)
        check_number("length_penalty", s.length_penalty, f"in [-{most:.4g}, {most:.4g}] with max_new_tokens="
                     f"{s.max_new_tokens} (length ** length_penalty must stay within float64)",
                     lambda v: abs(v) <= most)
    if not (isinstance(s.early_stopping, bool) or s.early_stopping == "never"):
        raise SettingError(f'early_stopping must be True, False or "never", got {s.early_stopping!r}', "early_stopping")
    check_int("num_return_sequences", s.num_return_sequences, f"in [1, num_beams={s.num_beams}]",
              lambda v: 1 <= v <= s.num_beams)
    if s.num_beams > 1:
        check_deterministic(s, f"beam search (num_beams={s.num_beams})")


def check_deterministic(s: SamplingSettings, method: str) -> None:
    """Beam and contrastive search: one sequence per prompt row and none of the logit warpers."""
    if s.num_samples != 1:
        raise SettingError(f"{method} is deterministic; num_samples must be 1, got {s.num_samples}", "num_samples")
    unsupported = [n for n, on in (("stop_strings", s.stop_strings), ("logit_bias", s.logit_bias),
                                   ("repetition_penalty", s.repetition_penalty != 1.0),
                                   ("presence_penalty", s.presence_penalty),
                                   ("frequency_penalty", s.frequency_penalty),
                                   ("no_repeat_ngram_size", s.no_repeat_ngram_size), ("bad_words", s.bad_words),
                                   ("min_new_tokens", s.min_new_tokens), ("suppress_tokens", s.suppress_tokens),
                                   ("prompt_lookup", s.prompt_lookup)) if on]
    if s.structured is not None:
        raise SettingError(f"{method} does not support structured outputs (structured={s.structured.kind}): "
                           f"use sampling or greedy decoding with a constraint", "structured")
    if unsupported:
        raise SettingError(f"{method} takes no {unsupported[0]}", unsupported[0])


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
