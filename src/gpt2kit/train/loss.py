"""The training loss without the (B, T, V) float32 logits: a fused, chunked linear cross-entropy.

A small GPT-2 spends most of a training step on its 50,257-way output layer: the (N, V) logits,
their float32 copy, the log-softmax, and the gradient of each are as big again, and on a CPU the
time goes into moving them through memory. fused_linear_cross_entropy takes the final hidden
states and the head matrix and works through N in chunks of rows: per chunk it forms the logits,
the loss and, when gradients are wanted, the gradient of the logits (softmax minus one-hot), which
it turns at once into the chunk's gradient for the hidden states and its share of the head's
gradient. No more than one chunk of logits exists at a time, and the matrix products are the same
three a plain head does (logits, d hidden, d weight), so nothing is recomputed. This is the
approach of Liger-Kernel's FusedLinearCrossEntropy, written with PyTorch operators.

The head may be the padded embedding (n_vocab_padded rows, e.g. 50,304, a friendlier GEMM
shape): the product runs over all its rows and the padded columns are masked to -inf before the
softmax, so they get probability 0 and gradient 0 (the loss is exactly the unpadded one).

TrainingLoss wraps a GPT2 as the module that training runs (and that DDP and torch.compile wrap):
forward(idx, targets) -> the mean next-token loss, equal to GPT2.forward(idx, targets=...).loss.

Distillation (a teacher given): the target of each row is no longer the data's token alone but the
mixture q = w * p_teacher + (1 - w) * one_hot(token), and the loss is the cross-entropy H(q, p_model)
(for w = 1 the KL divergence from the teacher plus the teacher's entropy, a constant). The gradient
of the logits is softmax - q, so the same chunked pass serves: per chunk the teacher's logits are
formed from its final hidden states and head, as the model's are (DistillSpec, Zhou et al. 2023,
trains draft models for speculative decoding this way).

Legend: B batch, T time, C n_embd, N = B*T rows, V n_vocab, Vp rows of the head (>= V).
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_CHUNK_ROWS = 256  # rows of logits per chunk: (256, 50304) float32 is 51 MB


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               n_vocab: int | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                               ignore_index: int = -100, teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
                               teacher_weight: float = 1.0) -> torch.Tensor:
    """Mean cross-entropy of logits = hidden @ weight[:n_vocab].T against targets, chunk by chunk.

    hidden (..., C), weight (Vp, C), targets (...) with the same leading shape as hidden. Rows
    whose target is ignore_index do not count (as F.cross_entropy). n_vocab (default Vp) is the
    number of real columns; weight's rows beyond it are padding and never predicted. Under
    autocast the products run in the autocast dtype, the softmax always in float32.
    """
    C = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != C:
        raise ValueError(f"weight must be (Vp, {C}), got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    n_vocab = weight.shape[0] if n_vocab is None else n_vocab
    if not 0 < n_vocab <= weight.shape[0]:
        raise ValueError(f"n_vocab must be in [1, {weight.shape[0]}], got {n_vocab}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if teacher is not None:
        th, tw = teacher
        if th.shape[:-1] != hidden.shape[:-1] or tw.dim() != 2 or tw.shape[1] != th.shape[-1] or tw.shape[0] < n_vocab:
            raise ValueError(f"teacher hidden {tuple(th.shape)} and head {tuple(tw.shape)} do not fit hidden "
                             f"{tuple(hidden.shape)} and n_vocab {n_vocab}")
        if not 0 < teacher_weight <= 1:
            raise ValueError(f"teacher_weight must be in (0, 1], got {teacher_weight}")
        teacher = (th.detach().reshape(-1, th.shape[-1]), tw.detach())
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return _FusedLinearCrossEntropy.apply(hidden.reshape(-1, C), weight, targets.reshape(-1), n_vocab,
                                          chunk_rows, ignore_index, dtype, teacher, teacher_weight)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_vocab: int,
                chunk_rows: int, ignore_index: int, dtype: torch.dtype,
                teacher: tuple[torch.Tensor, torch.Tensor] | None = None, tw_share: float = 1.0) -> torch.Tensor:
        # hidden (N, C), weight (Vp, C), targets (N,); teacher: its hidden (N, Ct) and head (Vt, Ct)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, Vp = hidden.shape[0], weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # (Vp, C); a no-op in float32
            valid = targets != ignore_index  # (N,)
            safe = torch.where(valid, targets, 0)  # (N,) ignored rows point at column 0, then weigh 0
            scale = valid.to(torch.float32) / valid.sum().clamp(min=1)  # (N,): 1/n_valid or 0
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if want_h else None  # (N, C)
            grad_w = torch.zeros(Vp, weight.shape[1], dtype=torch.float32, device=weight.device) if want_w else None
            # One logits buffer for every chunk, reused: a fresh 51 MB tensor per chunk is an mmap whose
            # pages the kernel zeroes on first touch, which cost as much as the softmax itself.
            buf = torch.empty(min(chunk_rows, N), Vp, dtype=torch.float32, device=hidden.device)
            if teacher is not None:
                t_head = teacher[1][:n_vocab].t()  # (Ct, V)
                t_buf = torch.empty(min(chunk_rows, N), n_vocab, dtype=torch.float32, device=hidden.device)
            for s in range(0, N, chunk_rows):
                h = hidden[s : s + chunk_rows].to(dtype)  # (n, C)
                n = h.shape[0]
                rows = torch.arange(n, device=h.device)
                logits = buf[:n]  # (n, Vp)
                if dtype == torch.float32:
                    torch.mm(h, w.t(), out=logits)
                else:
                    logits.copy_(h @ w.t())
                if Vp > n_vocab:
                    logits[:, n_vocab:] = float("-inf")
                t, sc = safe[s : s + chunk_rows], scale[s : s + chunk_rows]
                picked = logits[rows, t]  # (n,) the targets' logits (a copy)
                if teacher is not None:  # the soft target q = share * p_teacher + (1 - share) * one_hot
                    p_t = t_buf[:n]  # (n, V)
                    p_t.copy_(teacher[0][s : s + chunk_rows] @ t_head)
                    p_t.sub_(p_t.amax(dim=-1, keepdim=True)).exp_()
                    p_t.div_(p_t.sum(dim=-1, keepdim=True))  # the teacher's probabilities, in place
                    picked = tw_share * (p_t * logits[:, :n_vocab]).sum(-1) + (1 - tw_share) * picked  # (n,)
                # logsumexp and softmax in the buffer's own memory: max, exp(l - max), sum
                peak = logits.amax(dim=-1, keepdim=True)  # (n, 1)
                e = logits.sub_(peak).exp_()  # (n, Vp) exp(logits - max); padded columns exp(-inf) = 0
                sums = e.sum(dim=-1)  # (n,)
                lse = peak.squeeze(1) + sums.log()  # (n,)
                total += ((lse - picked) * sc).sum()
                if not (want_h or want_w):
                    continue
                # d loss / d logits = (softmax - one_hot) * scale, still in the buffer
                g = e.mul_((sc / sums)[:, None])  # (n, Vp)
                if teacher is None:
                    g[rows, t] -= sc
                else:
                    g[:, :n_vocab] -= p_t.mul_((tw_share * sc)[:, None])
                    if tw_share < 1:
                        g[rows, t] -= (1 - tw_share) * sc
                g = g.to(dtype)
                if want_h:
                    grad_h[s : s + chunk_rows] = (g @ w).to(hidden.dtype)  # (n, C)
                if want_w:
                    grad_w.addmm_(g.t().float() if dtype != torch.float32 else g.t(), h.float())  # (Vp, C)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if grad_w is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out if grad_h is not None else None
        gw = grad_w * grad_out if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None, None


class TrainingLoss(nn.Module):
    """A GPT2 seen as training sees it: forward(idx, targets) -> mean next-token cross-entropy.

    The hidden states come from the model's own forward (a hook on the last block catches them; the
    model is asked for the last position's logits only, a (B, 1, V) product that is thrown away),
    so the body is exactly the model's and nothing here depends on how it is written.

    teacher: a frozen GPT2 with the same vocabulary whose probabilities the model learns in training
    mode (teacher_weight of the target; the rest is the data's token); evaluation (eval mode) is
    always the data's cross-entropy. The teacher is held outside the module's parameters and
    state, so DDP, the optimizer and saving see only the model.
    """

    def __init__(self, model: nn.Module, *, chunk_rows: int = DEFAULT_CHUNK_ROWS, teacher: nn.Module | None = None,
                 teacher_weight: float = 1.0):
        super().__init__()
        self.model = model
        self.chunk_rows = chunk_rows
        self._teacher = (teacher,)  # a tuple: not registered as a submodule
        self.teacher_weight = teacher_weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = final_hidden(self.model, idx)  # (B, T, C)
        cfg = self.model.config
        wte = self.model.wte  # a swapped-in table with trained rows (gpt2kit.lora.TrainableTokens) merges them
        head = wte.merged_weight() if hasattr(wte, "merged_weight") else wte.weight
        teacher = self._teacher[0]
        soft = None
        if teacher is not None and self.training:
            with torch.no_grad():
                soft = (final_hidden(teacher, idx), teacher.wte.weight)  # (B, T, Ct), (Vt, Ct)
        return fused_linear_cross_entropy(hidden, head, targets, n_vocab=cfg.n_vocab, chunk_rows=self.chunk_rows,
                                          teacher=soft, teacher_weight=self.teacher_weight)


def final_hidden(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """A GPT2's ln_f of its last block's output for idx (B, T): the (B, T, C) states its tied head
    multiplies, from the model's own forward (its last position's logits computed and dropped)."""
    caught: list[torch.Tensor] = []

    def catch(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
        caught.append(output[0] if isinstance(output, tuple) else output)

    handle = model.h[-1].register_forward_hook(catch)
    try:
        model(idx, last_logits_only=True)
    finally:
        handle.remove()
    return model.ln_f(caught[0])
