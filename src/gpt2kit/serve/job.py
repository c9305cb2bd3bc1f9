"""One completion request's state while it runs: its rows, each row's choice as it grows, the work
it holds against the server's limits, and a beam or contrastive search's results."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import concurrent.futures

    import gpt2kit.serve.schemas as S
    from gpt2kit.engine import Row
    from gpt2kit.engine.beam import Beam


@dataclass(eq=False)
class Choice:
    prompt_index: int
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    last: float = 0.0  # time of the last token (per-token latency)

    def mean_logprob(self) -> float:
        return sum(self.logprobs) / max(len(self.logprobs), 1)


@dataclass(eq=False)
class Job:
    """One request's state; its rows' events arrive on `queue` (RowEvent, or a lifecycle sentinel)."""

    id: str
    created: int
    arrived: float
    prompts: list[list[int]]
    prompt_texts: list[str]
    body: S.CompletionRequest
    n: int
    best_of: int
    queue: asyncio.Queue
    rows: list[Row] = field(default_factory=list)
    choices: dict[Row, Choice] = field(default_factory=dict)
    pending: set = field(default_factory=set)
    first_token: bool = False
    watcher: asyncio.Task | None = None  # waits for the client to disconnect (serve/lifecycle.py)
    work: int = 0  # tokens of work it holds against the server's limit (gpt2kit.serve.limits)
    scoring: int = 0  # of which prompt tokens still to score for echo log-probs
    # beam or contrastive search (serve/search.py): each prompt's result, and a contrastive job
    found: dict[int, list[Beam]] = field(default_factory=dict)
    side: concurrent.futures.Future | None = None
    side_rows: int = 0  # rows the contrastive job holds against the server's limit
