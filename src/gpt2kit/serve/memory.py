"""A long-running server's memory, kept level: what one process sets up so that its resident set
after thousands of requests is where it settled after the first hundreds (measured in
docs/serving.md, "Memory").

Two things made it climb, each found by measurement (per-mapping RSS from /proc/PID/smaps, and
heaptrack for what stayed allocated):

- **oneDNN's compiled products.** Every prepacked product (gpt2kit.decode.packed) compiles a
  kernel and a descriptor for each row count it runs, and two caches (oneDNN's primitive cache
  and ideep's descriptor cache, 1,024 entries each by default) keep them, an entry pair per row count
  and product (its size in docs/serving.md). Prompt chunks and scored texts bring new row counts for a long
  time. ``bound_kernel_caches`` caps both (decode.packed.bound_caches) before the model's first
  oneDNN call.
- **Freed heap memory not given back.** glibc raises its mmap threshold after a large block is
  freed (up to 32 MiB), so the large, differently sized blocks echo scoring makes (logits of a
  whole prompt, the prefix cache's keys and values) then come from the heap, which fragments and
  keeps its pages. ``HeapTrim`` hands free pages back (``malloc_trim(0)``) once the engine has had
  no work for half a second (EngineLoop's tidy_after), and at most every ``every`` seconds while it
  stays busy (a call's cost in docs/serving.md). Fixing the threshold instead
  (``MALLOC_MMAP_THRESHOLD_=131072``) also kept it level but cost throughput (page faults on every
  large block).

Neither changes a number the server computes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

from gpt2kit.serve.options import ServeOptions


def bound_kernel_caches(opts: ServeOptions) -> dict[str, str]:
    """Cap oneDNN's caches for a server of these options (where the environment does not set them);
    the values in force. Call before the model's first oneDNN call (a loaded model that has already
    run a packed product keeps the capacity it started with)."""
    from gpt2kit.decode.packed import bound_caches, cache_entries

    speculating = opts.draft_model is not None or opts.prompt_lookup > 0
    return bound_caches(cache_entries(opts.max_batch, 2 if speculating else 1))


class HeapTrim:
    """Give the C heap's free pages back to the system: call() when the engine has just run out of
    work (idle=True), or between steps (idle=False: at most once every `every` seconds). A no-op
    where the C library has no malloc_trim (not glibc)."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.last = time.monotonic()
        self.calls = 0  # trims done (tests, /metrics-free introspection)
        self._trim = _malloc_trim()

    def __call__(self, idle: bool) -> None:
        now = time.monotonic()
        if self._trim is None or (not idle and now - self.last < self.every):
            return
        self._trim(0)
        self.last, self.calls = time.monotonic(), self.calls + 1


def _malloc_trim():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn
