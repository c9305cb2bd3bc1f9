"""Text generation: the scheduler (an engine that batches rows step by step) and the generator API.

One engine, :class:`Engine`, runs every generation: the CLI's, notebooks' (through
:func:`generate_stream` / :func:`generate` / :func:`stream_text`) and the server's (gpt2kit.serve,
through :class:`EngineLoop`, which drives it from a worker thread). Scheduling is per iteration, as
Orca and vLLM do it: a row (one sample of one prompt) joins the running batch at the next decode
step, after a prefill of its own, and leaves it the step it finishes, so short rows never wait for
long ones and new requests never wait for a batch to drain. :func:`generate_stream` submits all its
rows at step 0 (batch_size of them running at once) and yields one :class:`Step` per iteration.

Each row computes what it would alone: rows are right-aligned in one left-padded KV cache and their
positions come from the attention mask (so padding shifts nothing); each row samples with its own
:class:`gpt2kit.sampling.RowSampler` (its settings, its ``torch.Generator`` seeded from (seed,
sample index), its penalties' token sets), so what it draws does not depend on its neighbours.
The cache is rebuilt (rows concatenated, columns that are padding in every row trimmed, room for
the next tokens added) when rows join or it fills; finished and cancelled rows are dropped from it.

Past the context (GPT-2 has learned positions 0..n_ctx-1, so the cache cannot simply slide): the
model sees at most n_ctx tokens of a row. When a row's sequence (a prompt, or prompt + generated
tokens) would exceed n_ctx, its context is cut to its most recent ``window`` tokens (default
n_ctx // 2) and the row re-joins the batch with one prefill of that window. With ``strict=True``, a
prompt + max_new_tokens that would not fit raises ValueError before anything runs.

Settings, warpers and the draw live in gpt2kit.sampling (re-exported here); the model steps
(prefill, the one-token decode step and its kernels) in gpt2kit.decode.

Legend: B rows in the batch, T (padded) context length, P cached length, M cache size, V vocab,
L layers, nh heads, hs head size.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpt2kit.decode import Kernels, decode_step, kernels_for, prefill
from gpt2kit.kv_cache import KVCache
from gpt2kit.sampling import (  # noqa: F401 - re-exported: generate's names before the split (#9)
    EOT_ID,
    TOP_P_MODES,
    RowSampler,
    SamplingSettings,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_temperature,
    resolve_seed,
    row_generator,
    sample,
    top_k_filter,
    top_p_filter,
    warp,
)
from gpt2kit.validate import check_int

if TYPE_CHECKING:
    from gpt2kit.model import GPT2
    from gpt2kit.tokenizer import Tokenizer


# --- sampling a step ------------------------------------------------------------------------


def next_tokens(logits: torch.Tensor, samplers: Sequence[RowSampler]) -> torch.Tensor:
    """Each row's next token (B,): row r chooses from logits[r] (B, V) with samplers[r]."""
    if all(s.plain_greedy for s in samplers):
        return logits.argmax(dim=-1)  # one batched argmax: the same as row by row
    return torch.cat([s.choose(logits[r:r + 1]) for r, s in enumerate(samplers)])


# --- rows and their text ----------------------------------------------------------------------


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


@dataclass(eq=False)
class Row:
    """One sequence being generated (one sample of one prompt). Made by :meth:`Engine.new_row`."""

    prompt: list[int]
    settings: SamplingSettings
    sampler: RowSampler
    text: _RowText | None = None  # with a tokenizer
    logprobs: int | None = None  # report each token's log-prob and the top N alternatives; None: no
    key: object = None  # the caller's label (generate_stream: the sequence index)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled", once finished
    cancelled: bool = False
    start: int = 0  # the context is (prompt + tokens)[start:]
    ctx_len: int = 0  # tokens of this row in the engine's cache (its real, unpadded columns)

    def context(self, n_ctx: int, window: int) -> list[int]:
        seq = self.prompt + self.tokens
        if len(seq) - self.start > n_ctx:
            self.start = len(seq) - window
        return seq[self.start:]


@dataclass(frozen=True)
class RowEvent:
    """What one row did in one step: the token it added, the text that token made safe to emit
    ('' without a tokenizer), and with Row.logprobs its log-prob and the top N (id, log-prob)
    alternatives, all under the model's raw distribution (log_softmax of the logits, before any
    warper). finish_reason is set on the row's last event."""

    row: Row
    token: int
    text: str
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


# --- the engine -------------------------------------------------------------------------------


class Engine:
    """The iteration-level scheduler: rows wait, join the running batch at the next :meth:`step`
    (at most max_batch run at once), and leave it when they finish or are cancelled.

    Not thread-safe except :meth:`submit` and :meth:`cancel`; :class:`EngineLoop` runs one in a
    worker thread.
    """

    def __init__(self, model: GPT2, tokenizer: Tokenizer | None = None, *, max_batch: int | None = None,
                 pack_weights: bool | None = None) -> None:
        if max_batch is not None:
            check_int("max_batch", max_batch, ">= 1", lambda v: v >= 1)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch = max_batch
        self.pack_weights = pack_weights
        self.device = model.wte.weight.device
        self.rows: list[Row] = []  # running, in cache order
        self._waiting: deque[Row] = deque()
        self._lock = threading.Lock()
        self._cache: KVCache | None = None
        self._mask: torch.Tensor | None = None  # (B, M) long: 1 real, 0 padding; columns >= P preset to 1
        self._logits: torch.Tensor | None = None  # (B, V): each running row's next-token logits
        self._kernels: Kernels | None = None  # the decode kernel set (gpt2kit.decode.kernels_for)
        self._kernels_for: int | None = None  # the batch size _kernels was chosen for

    # -- rows in and out (any thread) --

    def new_row(self, prompt: Sequence[int], settings: SamplingSettings, *, seed: int | None = None,
                sample_index: int = 0, logprobs: int | None = None, key: object = None) -> Row:
        """A row for a prompt of valid token ids. seed: the run's seed (resolve_seed(settings) for
        one call); rows with equal (seed, sample_index) draw the same random numbers."""
        if settings.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer=...")
        if not settings.greedy and seed is None:
            raise ValueError("a sampled row needs a seed (gpt2kit.sampling.resolve_seed)")
        sampler = RowSampler(settings, prompt, self.model.config.n_vocab, seed, sample_index, self.device)
        text = _RowText(self.tokenizer, settings.stop_strings) if self.tokenizer is not None else None
        return Row(list(prompt), settings, sampler, text, logprobs, key)

    def submit(self, rows: Sequence[Row]) -> None:
        """Queue rows; they join the batch at the next step, in order, as room allows."""
        with self._lock:
            self._waiting.extend(rows)

    def cancel(self, row: Row) -> None:
        """Drop a row: waiting, it never runs; running, it leaves the batch at the next step."""
        row.cancelled = True

    @property
    def n_running(self) -> int:
        return len(self.rows)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self._waiting)

    def reset(self) -> list[Row]:
        """Drop every row, running and waiting; returns them (after an error, to fail them)."""
        with self._lock:
            dropped = self.rows + list(self._waiting)
            self._waiting.clear()
        self.rows = []
        self._cache = self._mask = self._logits = None
        return dropped

    # -- one iteration --

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """Admit waiting rows, then give every running row its next token; one event per row."""
        self._keep([r for r, row in enumerate(self.rows) if not row.cancelled])
        self._admit()
        if not self.rows:
            return []
        rows = self.rows
        tok = next_tokens(self._logits, [row.sampler for row in rows])  # (B,)
        scores = self._logprobs(tok)
        events, keep = [], []
        for r, (row, t) in enumerate(zip(rows, tok.tolist(), strict=True)):
            row.tokens.append(t)
            row.sampler.observe(t)
            piece, reason = self._advance(row, t)
            row.finish_reason = reason
            lp, top = scores.get(r, (None, None))
            events.append(RowEvent(row, t, piece, reason, lp, top))
            if reason is None:
                keep.append(r)
        self._keep(keep)
        tok = tok[keep] if len(keep) < len(rows) else tok
        # A row whose context is full re-joins with a window of its sequence (module doc).
        n_ctx = self.model.config.n_ctx
        full = [r for r, row in enumerate(self.rows) if row.ctx_len >= n_ctx]
        if full:
            with self._lock:
                self._waiting.extendleft(reversed([self.rows[r] for r in full]))
            keep = [r for r in range(len(self.rows)) if r not in set(full)]
            self._keep(keep)
            tok = tok[keep]
        if self.rows:
            self._feed(tok)
        return events

    def _advance(self, row: Row, t: int) -> tuple[str, str | None]:
        """The text token t makes safe to emit, and the row's finish reason (None: it goes on)."""
        reason = "stop" if t in row.settings.stop_token_ids else None  # not in the row's text
        piece, hit = "", False
        if row.text is not None and reason is None:
            piece, hit = row.text.feed(t)
            reason = "stop" if hit else None
        if reason is None and len(row.tokens) >= row.settings.max_new_tokens:
            reason = "length"
        if row.text is not None and reason is not None and not hit:
            piece += row.text.finish()  # after a stop string the rest is dropped; else release it
        return piece, reason

    def _logprobs(self, tok: torch.Tensor) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """Batch row -> (log-prob of its token, top N (id, log-prob)) for rows that asked."""
        want = [r for r, row in enumerate(self.rows) if row.logprobs is not None]
        if not want:
            return {}
        sel = torch.tensor(want, device=self.device)
        logp = torch.log_softmax(self._logits[sel].float(), dim=-1)  # (R, V)
        chosen = logp.gather(1, tok[sel][:, None])[:, 0].tolist()
        n = max(self.rows[r].logprobs for r in want)
        ids = vals = [[] for _ in want]
        if n:
            top = logp.topk(min(n, logp.shape[-1]), dim=-1)
            ids, vals = top.indices.tolist(), top.values.tolist()
        out = {}
        for i, r in enumerate(want):
            k = self.rows[r].logprobs
            out[r] = (chosen[i], tuple(zip(ids[i][:k], vals[i][:k], strict=True)))
        return out

    # -- the batch tensors --

    def _admit(self) -> None:
        with self._lock:
            room = len(self._waiting) if self.max_batch is None else self.max_batch - len(self.rows)
            join = []
            while self._waiting and len(join) < room:
                row = self._waiting.popleft()
                if not row.cancelled:
                    join.append(row)
        if join:
            self._join(join)

    def _window(self, row: Row) -> int:
        return row.settings.window or max(self.model.config.n_ctx // 2, 1)

    def _join(self, rows: list[Row]) -> None:
        """Prefill the joining rows (left-padded among themselves) and add them to the batch."""
        n_ctx, n_vocab = self.model.config.n_ctx, self.model.config.n_vocab
        contexts = [row.context(n_ctx, self._window(row)) for row in rows]
        B, T = len(rows), max(map(len, contexts))
        idx = torch.full((B, T), EOT_ID % n_vocab, dtype=torch.long)  # (B, T)
        mask = torch.ones(B, T, dtype=torch.long)  # (B, T)
        for r, ctx in enumerate(contexts):
            idx[r, T - len(ctx):] = torch.tensor(ctx)
            mask[r, : T - len(ctx)] = 0
            rows[r].ctx_len = len(ctx)
        idx, mask = idx.to(self.device), mask.to(self.device)
        padded = any(len(c) < T for c in contexts)
        cache = KVCache.for_model(self.model, B, T)
        logits = prefill(self.model, idx, mask if padded else None, cache)  # (B, V)
        parts = [(cache.kv, mask)]
        if self.rows:
            parts.insert(0, self._used())
            logits = torch.cat([self._logits, logits])
        self.rows = self.rows + rows
        self._logits = logits
        self._rebuild(parts)

    def _used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache and mask columns some row still uses: [c0, P), leading all-padding cut off."""
        P = self._cache.length
        c0 = P - max(row.ctx_len for row in self.rows)
        return self._cache.kv[:, :, :, :, c0:P], self._mask[:, c0:P]

    def _rebuild(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One cache from parts (kv (L, b, 2, nh, w, hs), mask (b, w)), right-aligned, with room
        for the next tokens; padding is zeros (finite: masked keys get weight 0, never 0 * NaN)."""
        W = max(m.shape[1] for _, m in parts)
        to_feed = max(row.settings.max_new_tokens - len(row.tokens) for row in self.rows)
        M = W + max(1, min(to_feed, 256))  # rebuilt again if it fills (rows that go on past it)
        L, _, _, nh, _, hs = parts[0][0].shape
        cache = KVCache(L, len(self.rows), nh, M, hs, device=self.device, dtype=parts[0][0].dtype)
        cache.kv.zero_()
        mask = torch.ones(len(self.rows), M, dtype=torch.long, device=self.device)  # (B, M)
        b = 0
        for kv, m in parts:
            n, w = m.shape
            cache.kv[:, b:b + n, :, :, W - w:W] = kv
            mask[b:b + n, : W - w] = 0
            mask[b:b + n, W - w:W] = m
            b += n
        cache.length = W
        self._cache, self._mask = cache, mask

    def _keep(self, keep: list[int]) -> None:
        """Keep only batch rows `keep` (the others finished, were cancelled or re-join)."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        if not keep:
            self._cache = self._mask = self._logits = None
            return
        sel = torch.tensor(keep, device=self.device)
        self._cache.select(sel)
        self._mask, self._logits = self._mask[sel], self._logits[sel]

    def _feed(self, tok: torch.Tensor) -> None:
        """Feed each running row's newest token tok (B,); their next logits become pending."""
        if self._cache.length == self._cache.max_len:
            self._rebuild([self._used()])
        P, B = self._cache.length, len(self.rows)
        padded = any(row.ctx_len < P for row in self.rows)
        mask = self._mask[:, : P + 1] if padded else None  # (B, P + 1)
        if self._kernels_for != B:
            self._kernels, self._kernels_for = kernels_for(self.model, B, self.pack_weights), B
        self._logits = decode_step(self.model, tok[:, None], self._cache, mask, self._kernels)
        for row in self.rows:
            row.ctx_len += 1


class EngineLoop:
    """Runs an :class:`Engine` in a worker thread, so that the caller's thread (an event loop) never
    waits on the model. on_events(events) is called from the worker after every step; on_error(rows,
    exc) when a step raises (the rows are dropped, the loop goes on). :meth:`call` runs a function
    in the worker between steps (e.g. scoring a prompt) and returns a concurrent Future."""

    def __init__(self, engine: Engine, on_events: Callable[[list[RowEvent]], None],
                 on_error: Callable[[list[Row], BaseException], None]) -> None:
        import concurrent.futures

        self._futures = concurrent.futures
        self.engine, self.on_events, self.on_error = engine, on_events, on_error
        self._cond = threading.Condition()
        self._jobs: deque = deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gpt2kit-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, rows: Sequence[Row]) -> None:
        self.engine.submit(rows)
        with self._cond:
            self._cond.notify()

    def cancel(self, row: Row) -> None:
        self.engine.cancel(row)

    def call(self, fn: Callable, *args, **kwargs):
        fut = self._futures.Future()
        with self._cond:
            self._jobs.append((fut, fn, args, kwargs))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._jobs or self.engine.has_work):
                    self._cond.wait()
                if self._stop:
                    return
                jobs, self._jobs = list(self._jobs), deque()
            for fut, fn, args, kwargs in jobs:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args, **kwargs))
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as e:  # fail the rows, keep serving
                    self.on_error(self.engine.reset(), e)
                    continue
                self.on_events(events)


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


MAX_ROWS = 65536  # rows (prompts x samples) of one generate call


def generate_stream(model: GPT2, prompts: Sequence[Sequence[int]], settings: SamplingSettings | None = None,
                    *, tokenizer: Tokenizer | None = None, batch_size: int | None = None) -> Iterator[Step]:
    """Generate for token-id prompts, yielding one :class:`Step` per decode step.

    Rows are the prompts x settings.num_samples (sequence index prompt_index * num_samples +
    sample_index), at most batch_size running at once (default: all); a row that finishes makes
    room for the next at the following step. With a tokenizer, each step also carries the new
    text of each row and stop_strings apply. Bad arguments raise ValueError here, before the
    first step.
    """
    engine, _ = _start(model, prompts, settings or SamplingSettings(), tokenizer, batch_size)
    return _stream(model, engine)


def _start(model: GPT2, prompts: Sequence[Sequence[int]], settings: SamplingSettings, tokenizer: Tokenizer | None,
           batch_size: int | None) -> tuple[Engine, list[list[int]]]:
    """Check every argument, then an Engine holding all the rows; also the prompts as id lists."""
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
        check_int("batch_size", batch_size, ">= 1", lambda v: v >= 1)

    n = settings.num_samples
    if len(prompts) * n > MAX_ROWS:
        raise ValueError(f"{len(prompts)} prompt(s) x num_samples={n} = {len(prompts) * n} rows; at most "
                         f"{MAX_ROWS} per call (each row's state is made up front): call again for more")
    engine = Engine(model, tokenizer, max_batch=batch_size, pack_weights=settings.pack_weights)
    seed = resolve_seed(settings)
    engine.submit([engine.new_row(p, settings, seed=seed, sample_index=j, key=i * n + j)
                   for i, p in enumerate(prompts) for j in range(n)])
    return engine, prompts


def _stream(model: GPT2, engine: Engine) -> Iterator[Step]:
    was_training = model.training
    model.eval()  # dropout off while generating; restored when the iterator ends or is closed
    try:
        while engine.has_work:
            events = engine.step()
            yield Step({e.row.key: e.token for e in events},
                       {e.row.key: e.text for e in events if e.row.text is not None},
                       {e.row.key: e.finish_reason for e in events if e.finish_reason})
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
    engine, prompts = _start(model, prompts, settings, tokenizer, batch_size)
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
