"""The warpers and constraints of transformers' generate beyond OpenAI's sample.py, each computed as
its transformers logits processor (named in its doc) computes it, so the tokens kept and their
renormalised probabilities are the same.

Warpers truncate a sampled distribution (applied after temperature, top-k and top-p; never in greedy
decoding, as transformers): min-p, locally typical, epsilon and eta sampling. Constraints ban tokens
(greedy too): a repeated n-gram, bad words, the stop tokens before a minimum of new tokens, suppressed
tokens. gpt2kit.sampling.sampler applies them in transformers' order; the per-row state the constraints need
(the row's sequence, its n-grams) lives in gpt2kit.sampling.sampler.RowSampler, which holds the objects here.

Legend: B rows, V vocab.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

_NEG_INF = float("-inf")


# --- warpers (logits (B, V) float32 -> the same with removed tokens at -inf) ------------------


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p sampling (MinPLogitsWarper): drop the tokens whose probability is below min_p times the
    most likely token's; that one always stays."""
    probs = logits.softmax(dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return logits.masked_fill(remove, _NEG_INF)


def typical_filter(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; TypicalLogitsWarper): rank tokens by how far their
    information -log p is from the entropy, keep the closest whose probability reaches mass."""
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)  # (B, 1)
    shifted = torch.abs(-logp - entropy)
    sorted_shift, order = torch.sort(shifted, descending=False)  # (B, V)
    cum = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=1).clamp_(max=sorted_shift.shape[-1] - 1)  # (B,)
    remove_sorted = sorted_shift > sorted_shift.gather(1, last.view(-1, 1))
    remove_sorted[..., :1] = False  # the most typical token always stays
    return logits.masked_fill(remove_sorted.scatter(1, order, remove_sorted), _NEG_INF)


def epsilon_filter(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Epsilon sampling (Hewitt et al.; EpsilonLogitsWarper): drop the tokens with probability below
    epsilon, keeping the most likely one."""
    remove = logits.softmax(dim=-1) < epsilon
    return logits.masked_fill(remove & (logits < logits.amax(dim=-1, keepdim=True)), _NEG_INF)


def eta_filter(logits: torch.Tensor, eta: float) -> torch.Tensor:
    """Eta sampling (Hewitt et al.; EtaLogitsWarper): epsilon sampling with the cutoff
    min(eta, sqrt(eta) * exp(-entropy)), so a flat distribution keeps more tokens."""
    eps = torch.tensor(eta, device=logits.device)
    entropy = torch.distributions.Categorical(logits=logits).entropy()  # (B,)
    cutoff = torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))[..., None]  # (B, 1)
    remove = logits.softmax(dim=-1) < cutoff
    return logits.masked_fill(remove & (logits < logits.amax(dim=-1, keepdim=True)), _NEG_INF)


# --- constraints: the tokens a row may not produce next, from its sequence -------------------


class NGramIndex:
    """No n-gram twice in a row's sequence, prompt included (NoRepeatNGramLogitsProcessor): for each
    (n-1)-gram seen, the tokens that followed it; the next token may not complete one of those."""

    def __init__(self, n: int, seq: Sequence[int]) -> None:
        self.n = n
        self.next: dict[tuple[int, ...], set[int]] = {}
        for end in range(n, len(seq) + 1):
            self._add(seq[end - n:end])

    def _add(self, gram: Sequence[int]) -> None:
        self.next.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    def observe(self, seq: Sequence[int]) -> None:
        """seq just grew by one token."""
        if len(seq) >= self.n:
            self._add(seq[len(seq) - self.n:])

    def banned(self, seq: Sequence[int]) -> Collection[int]:
        if len(seq) < self.n:
            return ()
        return self.next.get(tuple(seq[len(seq) - self.n + 1:]), ())


class BadWords:
    """Token sequences never generated (NoBadWordsLogitsProcessor): a one-token word is always
    banned; a longer one bans its last token where the sequence ends with the rest of it. As
    transformers does, a one-token word that is a stop token is dropped (stopping stays possible:
    use min_new_tokens or suppress_tokens to ban it)."""

    def __init__(self, words: Sequence[Sequence[int]], stop_ids: Collection[int]) -> None:
        words = [tuple(w) for w in words if not (len(w) == 1 and w[0] in stop_ids)]
        self.always = sorted({w[0] for w in words if len(w) == 1})
        self.prefixed = [(w[:-1], w[-1]) for w in words if len(w) > 1]

    def banned(self, seq: Sequence[int]) -> list[int]:
        n = len(seq)
        return [last for prefix, last in self.prefixed
                if len(prefix) <= n and tuple(seq[n - len(prefix):]) == prefix]
