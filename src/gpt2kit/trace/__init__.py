"""The forward pass made visible, exactly: `trace(model, tokenizer, text_or_ids)` -> `Trace`.

Every intermediate is recorded by forward hooks on the network's own modules (wte, wpe, drop, each
block's ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, the block itself, ln_f), so
the numbers are the ones the forward pass computed; the hooks only read. The one thing the network
does not materialise is the attention matrix (SDPA fuses it away), so scores and probabilities are
derived from the recorded q and k: q k^T / sqrt(hs), causal mask, softmax (proven equal to
transformers' eager attention in tests/test_trace.py).

Names (spec notation in docs/trace.md; one input, so no batch axis):
  embed.tok (T, C) wte[X]                      embed.pos (T, C) wpe[pos]
  resid.{l} (T, C) H^(l), l = 0..L (resid.0 = wte[X] + wpe[pos]; resid.{i+1} = block i's output)
  h.{i}.ln_1 (T, C)   h.{i}.attn.q/k/v (nh, T, hs)   h.{i}.attn.scores/probs (nh, T, T)
  h.{i}.attn.z (nh, T, hs) = P V per head      h.{i}.attn.out (T, C) A = c_proj(merge(z))
  h.{i}.resid_mid (T, C) H' = H + A            h.{i}.ln_2 (T, C)
  h.{i}.mlp.pre (T, 4C) c_fc   h.{i}.mlp.post (T, 4C) GELU   h.{i}.mlp.out (T, C) M
  ln_f (T, C)   logits (T, V)

Legend: T tokens, C n_embd, nh heads, hs head size, L layers, V vocab.
"""

from gpt2kit.trace.api import Trace, trace
from gpt2kit.trace.intervene import Intervention, ablate, hook, replace, steer
from gpt2kit.trace.points import ALIASES, run_with_hooks
from gpt2kit.trace.record import GROUPS, KINDS, attention_from_qk, parse_layers, parse_what, run_hooked
from gpt2kit.trace.steering import Clamp, Interventions, clamp

__all__ = ["ALIASES", "GROUPS", "KINDS", "Clamp", "Intervention", "Interventions", "Trace", "ablate",
           "attention_from_qk", "clamp", "hook", "parse_layers", "parse_what", "replace", "run_hooked",
           "run_with_hooks", "steer", "trace"]
