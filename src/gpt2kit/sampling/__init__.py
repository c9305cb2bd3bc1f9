"""Decoding settings and the draw: what to sample, and how.

- settings.py  SamplingSettings and its checks (no torch: the CLI builds its flags from it)
- warpers.py   the logit processors (repetition and presence penalties, bad words, bias, ...)
- constraint.py  structured outputs' Constraint (a JSON schema, regex, choice or grammar; checked by llguidance)
- structured.py  the per-row grammar matcher and its token mask (torch)
- sampler.py   the draw: temperature, top-k, top-p, min-p and typical filtering over a batch, seeded per row

This face hands on the settings only, so `from gpt2kit.sampling import SamplingSettings` stays torch-free.
"""

from gpt2kit.sampling.constraint import Constraint
from gpt2kit.sampling.settings import (
    EOT_ID,
    GREEDY_BELOW,
    MAX_BEAMS,
    TOP_P_MODES,
    SamplingSettings,
    bad_word_text,
    bad_words_ids,
    check_deterministic,
)

__all__ = ["Constraint", "EOT_ID", "GREEDY_BELOW", "MAX_BEAMS", "TOP_P_MODES", "SamplingSettings", "bad_word_text",
           "bad_words_ids", "check_deterministic"]
