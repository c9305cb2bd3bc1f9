"""A kernel choice that cannot collapse: a known-good default per CPU family, a measurement that only
overrides it on clear evidence, and the result kept per machine so a process does not re-measure under
whatever load it starts in.

gpt2kit.decode.int8 (the int8 products) and gpt2kit.decode.plain (the half-precision few-row
products) decide between kernels by timing them. A single best-of-3 timing at start-up flipped under
load (one process on a busy machine chose a kernel far slower for single rows, and int8 decoding fell
below float32; docs/benchmarks.md), so a choice here is made by `decide` on samples taken in interleaved rounds:

- the family default (`family()`: "amx", "avx512", "avx2" or "other", from the CPU's flags as
  gpt2kit.machine reads them) is what runs unless a measurement says otherwise;
- each candidate's figure is the median of its rounds; if any candidate's samples spread (interquartile
  range) over more than NOISE of its median, the machine was busy: the default stays;
- `bound`: for products of a few rows (weight streaming), int8 reads a quarter of float32's bytes, so
  a fastest int8 candidate slower than the float32 product is a disturbed measurement: the default stays;
- a candidate other than the default wins only when it is MARGIN faster than the default.

A measured choice (not a default kept for want of evidence) is stored in `Store`: the JSON file
kernel-choices.json in $GPT2KIT_KERNEL_STORE, else the kernel cache directory (decode/native.py's
`cache_dir()`, ~/.cache/gpt2kit/kernels), under this machine's key (CPU model, all its flags, torch's and
gpt2kit's versions, the hash of the native kernels' sources) and the product's bucket (what, device, dtype,
rows, threads). The directory and the file follow kernel_cache's rules (this user's alone to write); a
file that is another user's, writable by others, or not valid JSON of this format is ignored (with a
RuntimeWarning) and rewritten whole on the next store, atomically. Entries of other machines in the file are kept.

Every family's choices in this process live in one Registry, REGISTRY (family "f32", "half", "int8",
"int8act", and the family's own key for the bucket): `settle` takes the stored choice where it is
still right, else measures (storing what the measurement decided); `chosen` is what the products
read on every call; `decisions` what `gpt2kit bench --kernels` lists.

GPT2KIT_KERNEL_TIMINGS (JSON: {candidate: seconds or [seconds, ...]}, "float32" for the bound) replaces
the timings of a measurement, never its correctness checks: the tests' seam, and a way to replay a
decision.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gpt2kit.decode.kernel_cache as kernel_cache
import gpt2kit.decode.native as native
from gpt2kit.machine import cpu_flags, cpu_info, cpu_ticks

STORE_ENV = "GPT2KIT_KERNEL_STORE"
TIMINGS_ENV = "GPT2KIT_KERNEL_TIMINGS"
STORE_NAME = "kernel-choices.json"
FORMAT = 1
ROUNDS = 7  # interleaved rounds of a measurement; each candidate's figure is its median
MARGIN = 0.10  # a measured candidate replaces the default only when this much faster than it
BUSY = 0.25  # cores of other processes' work during a measurement that make it untrusted
NOISE = 0.5  # an interquartile range above this fraction of the median: the machine was busy
SOURCES = ("default", "stored", "measured", "forced")
_MAX_BYTES = 256 << 10


def family(flags: frozenset[str] | None = None) -> str:
    """The CPU's family for the defaults: "amx", "avx512", "avx2" (with FMA) or "other"."""
    flags = cpu_flags() if flags is None else flags
    if flags & {"amx_bf16", "amx_int8", "amx_tile"}:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "other"


# The CPU families whose defaults (f32.DEFAULTS, int8.DEFAULTS, int8act.DEFAULTS, plain's half kernels)
# were measured, each with the flags of the machine they were measured on (docs/benchmarks.md names it).
# A CPU of a family not here, or lacking one of those flags, runs defaults nobody measured on it.
MEASURED = {
    "amx": ("the AMX Xeon of docs/benchmarks.md", frozenset({"avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"})),
    "avx512": ("the AVX-512 EPYC of docs/benchmarks.md", frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})),
    "avx2": ("the AVX2 EPYC of docs/benchmarks.md", frozenset({"avx2", "fma"})),
}


def unmeasured(flags: frozenset[str] | None = None) -> str | None:
    """None where this CPU's family defaults were measured on a CPU with its flags; else one line saying
    they were not, and how to measure them here."""
    flags = cpu_flags() if flags is None else flags
    fam = family(flags)
    how = ("its products start on the defaults below, not measured on such a CPU: run `gpt2kit bench --kernels "
           "--remeasure` on a quiet machine to measure and store this machine's choices")
    if fam not in MEASURED:
        return f"kernel defaults: this CPU's family ({fam}) was never measured; {how}"
    where, needed = MEASURED[fam]
    missing = sorted(needed - flags)
    if missing:
        return (f"kernel defaults: the {fam} family's were measured on {where}, which has {', '.join(missing)} "
                f"and this CPU does not; {how}")
    return None


def machine_key() -> str:
    """What a stored choice is valid for: the CPU's model and flags, torch's version and the native
    kernels' sources (a changed kernel is measured anew)."""
    flags = " ".join(sorted(cpu_flags()))
    return (f"{cpu_info()['cpu']} | flags {flags} | torch {torch.__version__}"
            f" | kernels {native.sources_digest()}")


@dataclass
class Choice:
    kernel: str
    source: str  # one of SOURCES
    why: str
    medians_ms: dict[str, float] = field(default_factory=dict)  # each candidate's median ("float32": the bound)

    def as_json(self) -> dict:
        return {"kernel": self.kernel, "source": self.source, "why": self.why, "medians_ms": self.medians_ms}


def check_named(name: str, kernels: Sequence[str], why_not: Callable[[str, torch.device], str | None],
                device: torch.device | str, said: str, what: str) -> str:
    """`name` if it is one of `kernels` and can run on `device` here (why_not(kernel, device) is None);
    ValueError naming it as `said` and the choices otherwise (`what`: "a kernel", ...)."""
    if name not in kernels:
        raise ValueError(f"{said} is not {what}; valid choices: {', '.join(kernels)}")
    why = why_not(name, torch.device(device))
    if why:
        ok = [k for k in kernels if not why_not(k, torch.device(device))]
        raise ValueError(f"{said} is unavailable here ({why}); available: {', '.join(ok)}")
    return name


def _spread(xs: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than 4 samples: nothing to judge by)."""
    if len(xs) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4)
    med = statistics.median(xs)
    return (q3 - q1) / med if med > 0 else float("inf")


def decide(samples: Mapping[str, Sequence[float]], default: str, bound: Sequence[float] | None = None,
           margin: float = MARGIN, noise: float = NOISE) -> Choice:
    """The kernel to run from `samples` (candidate -> seconds per product, one per round), `default`
    (the family's known-good kernel, one of the candidates) and `bound` (the float32 product's samples:
    a fastest candidate slower than it is not believed). Source "measured" when the samples decided,
    "default" when they were missing, disturbed or beyond the bound."""
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    shown = {k: round(v * 1e3, 4) for k, v in med.items()}
    if bound:
        shown["float32"] = round(statistics.median(bound) * 1e3, 4)
    if not med:
        return Choice(default, "default", "nothing was measured", shown)
    busy = [k for k, v in {**samples, **({"float32": bound} if bound else {})}.items() if _spread(v) > noise]
    if busy:
        return Choice(default, "default", f"the measurement was disturbed ({', '.join(busy)} spread over more than "
                                          f"{noise:.0%} of the median)", shown)
    best = min(med, key=med.get)
    if bound and med[best] > statistics.median(bound):
        return Choice(default, "default", f"the fastest candidate ({best}) measured slower than the float32 "
                                          "product, which reads 4x the bytes: a disturbed measurement", shown)
    if best != default and default in med and med[best] > (1 - margin) * med[default]:
        return Choice(default, "measured", f"{best} was within {margin:.0%} of the default", shown)
    return Choice(best, "measured", "fastest" + ("" if best == default else f", over {margin:.0%} ahead of "
                                                 f"the default {default}"), shown)


def others_busy(fn: Callable[[], object]) -> tuple[object, float]:
    """fn()'s result and the cores' worth of CPU other processes used while it ran (0 where /proc is absent)."""
    before, t0 = cpu_ticks(), time.perf_counter()
    out = fn()
    after, dt = cpu_ticks(), time.perf_counter() - t0
    if before is None or after is None or dt <= 0:
        return out, 0.0
    return out, max(0, (after[0] - before[0]) - (after[1] - before[1])) / (dt * os.sysconf("SC_CLK_TCK"))


def measured(fn: Callable[[], Mapping[str, Sequence[float]]], default: str,
             default_of: Callable[[Mapping[str, Sequence[float]]], str] | None = None,
             bound_key: str | None = None) -> Choice:
    """Take samples with fn() and `decide` on them; when other processes used more than BUSY cores
    meanwhile (and the timings were not given by GPT2KIT_KERNEL_TIMINGS) the default stays, whatever
    the samples say: a measurement on a busy machine decides nothing. `default_of(samples)` picks the
    default among what was measured; `bound_key` is the float32 product's entry."""
    samples, busy = others_busy(fn)
    samples = dict(samples)
    bound = samples.pop(bound_key, None) if bound_key else None
    if default_of is not None:
        default = default_of(samples)
    choice = decide(samples, default, bound)
    if busy > BUSY and forced_timings() is None:
        return Choice(default, "default", f"other processes used {busy:.1f} cores during the measurement",
                      choice.medians_ms)
    return choice


def forced_timings() -> dict[str, list[float]] | None:
    """GPT2KIT_KERNEL_TIMINGS as {candidate: [seconds, ...]}, or None when unset; ValueError naming it
    when it is not such a JSON object."""
    text = os.environ.get(TIMINGS_ENV)
    if not text:
        return None
    try:
        data = json.loads(text)
        out = {str(k): [float(v)] if isinstance(v, (int, float)) else [float(x) for x in v]
               for k, v in data.items()}
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"{TIMINGS_ENV} must be a JSON object of candidate: seconds (or a list of them), "
                         f"got {text[:80]!r}") from None
    if not all(t and all(x > 0 for x in t) for t in out.values()):
        raise ValueError(f"{TIMINGS_ENV}: every timing must be a positive number of seconds, got {text[:80]!r}")
    return out


def store_dir() -> Path:
    return Path(os.environ.get(STORE_ENV) or native.cache_dir())


class Store:
    """The stored choices of this machine (see the module's docstring); `directory` defaults to store_dir()."""

    def __init__(self, directory: Path | str | None = None):
        self.directory = Path(directory) if directory is not None else store_dir()

    def get(self, bucket: str) -> Choice | None:
        entry = self._read().get("machines", {}).get(machine_key(), {}).get(bucket)
        if not (isinstance(entry, dict) and isinstance(entry.get("kernel"), str)):
            return None
        medians = entry.get("medians_ms") if isinstance(entry.get("medians_ms"), dict) else {}
        return Choice(entry["kernel"], "stored", f"measured earlier ({entry.get('why', '')})", medians)

    def put(self, bucket: str, choice: Choice) -> bool:
        """Store `choice` for `bucket` on this machine (the file rewritten atomically); False where the
        directory cannot be used."""
        data = self._read()
        machines = data.setdefault("machines", {})
        machines.setdefault(machine_key(), {})[bucket] = choice.as_json()
        cache = kernel_cache.open_cache(self.directory)
        if cache is None:
            return False
        try:
            return cache.write_private(STORE_NAME, json.dumps(data, indent=1, sort_keys=True).encode())
        finally:
            cache.close()

    def _read(self) -> dict:
        cache = kernel_cache.open_cache(self.directory)
        if cache is None:
            return {"format": FORMAT, "machines": {}}
        try:
            blob = cache.read_private(STORE_NAME, _MAX_BYTES, "the stored kernel choices", "measuring again")
        finally:
            cache.close()
        if blob is None:
            return {"format": FORMAT, "machines": {}}
        try:
            data = json.loads(blob)
            ok = (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("machines"), dict)
                  and all(isinstance(m, dict) for m in data["machines"].values()))
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            warnings.warn(f"ignored the stored kernel choices {self.directory / STORE_NAME}: not a gpt2kit "
                          f"kernel-choice file of format {FORMAT} (corrupt or truncated); measuring again",
                          RuntimeWarning, stacklevel=3)
            return {"format": FORMAT, "machines": {}}
        return data


class Registry:
    """The kernel chosen for each product bucket in this process, every kernel family's in one table
    (module doc). `chosen` maps (family, key) to the kernel: a plain dict, read by the products."""

    def __init__(self) -> None:
        self.chosen: dict[tuple[str, Hashable], str] = {}
        self._why: dict[tuple[str, Hashable], Choice] = {}

    def settle(self, family: str, key: Hashable, bucket: str, still_right: Callable[[str], bool],
               measure: Callable[[], Choice], *, fresh: bool = False) -> Choice:
        """The choice for (family, key): the one stored for this machine under `bucket` where
        still_right(kernel) (never with `fresh`), else measure()'s, stored when the measurement
        decided it; this process's choice for the bucket from then on."""
        store = Store()
        choice = None if fresh else store.get(bucket)
        if choice is not None and not still_right(choice.kernel):
            choice = None
        if choice is None:
            choice = measure()
            if choice.source == "measured":
                store.put(bucket, choice)
        self.set(family, key, choice)
        return choice

    def set(self, family: str, key: Hashable, choice: Choice) -> None:
        self.chosen[(family, key)], self._why[(family, key)] = choice.kernel, choice

    def decisions(self, family: str) -> dict[Hashable, Choice]:
        """How each of the family's buckets was chosen, by its key."""
        return {k: c for (f, k), c in self._why.items() if f == family}

    def forget(self, family: str) -> None:
        """Forget the family's choices: its next product decides again."""
        for k in [k for k in self._why if k[0] == family]:
            del self.chosen[k], self._why[k]


REGISTRY = Registry()
