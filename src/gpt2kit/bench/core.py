"""`gpt2kit bench`: generation speed against transformers, side by side in one run.

Both libraries run the same random-weight GPT-2 124M (gpt2kit's init; transformers gets a copy of
the weights), eagerly, with default settings and the same thread count, on the same prompts:

* prefill: tokens/s encoding a T = 1024 prompt into the KV cache (logits of the last position
  only, as both generators do: gpt2kit's ``prefill``, transformers' ``logits_to_keep=1``);
* decode: tokens/s of greedy generation of 128 new tokens after a 16-token prompt, at batch 1 and
  batch 8, through each library's own generate (prefill included, no stop token);
* peak memory: the peak RSS of a fresh process (VmHWM), above its RSS after imports, while it
  builds the model and runs the T = 1024 prefill and the batch-8 decode (tracemalloc cannot see
  PyTorch's allocator);
* the physical limit of batch-1 decode: the bytes of weights each token reads, divided by the
  memory bandwidth measured in the same run (a 1 GiB float32 sum).

gpt2kit runs in float32 and in bfloat16 (``model.to(torch.bfloat16)``); transformers in float32.
``--device cuda`` runs it all on a GPU (peak memory is then the GPU memory allocated).
Each timing is the best of a few trials, alternating the libraries; on Linux a trial during which
other processes used the CPU is discarded (and retried) when possible, and the table says how many
trials were quiet. Ratios are gpt2kit / transformers (for memory, lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt2kit._io import atomic_write_text
from gpt2kit.bench.machine import cpu_info
from gpt2kit.checkpoint.keymap import to_hf_state
from gpt2kit.config import GPT2Config
from gpt2kit.decode import prefill, use_decode_layout
from gpt2kit.decode.int8 import chosen
from gpt2kit.generate import SamplingSettings, generate
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2
from gpt2kit.quant import check_scheme, quantize_model, quantized_skeleton, weight_bytes
from gpt2kit.tokenizer import Tokenizer

TARGETS = {  # gpt2kit / transformers float32, from the generation issue
    ("decode_b1", "float32"): 1.1, ("decode_b1", "bfloat16"): 1.8, ("decode_b8", "float32"): 1.6,
    ("prefill", "float32"): 1.0, ("prefill", "bfloat16"): 1.6,
    ("decode_b1", "int8"): 2.5, ("decode_b8", "int8"): 2.0,  # the int8 issue (with --quantize int8)
}
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. "
)


# --- timing ---------------------------------------------------------------------------------------


@dataclass
class Timing:
    seconds: float  # best trial
    quiet: int  # trials during which no other process used the CPU
    trials: int


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of the whole machine, ticks of this process), or None where /proc is absent."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    t = os.times()
    return sum(v) - v[3] - v[4], round((t.user + t.system) * os.sysconf("SC_CLK_TCK"))


def _wait_for_idle(max_wait: float, idle: float = 1.0) -> None:
    """On a shared machine, wait (at most max_wait s) until other processes have left the CPU
    alone for `idle` seconds, so that a trial has a chance to be quiet."""
    start = last = _cpu_ticks()
    if start is None:
        return
    t0 = quiet_since = time.monotonic()
    while time.monotonic() - t0 < max_wait and time.monotonic() - quiet_since < idle:
        time.sleep(0.2)
        now = _cpu_ticks()
        if (now[0] - last[0]) - (now[1] - last[1]) > 4:  # over ~20% of a core in 0.2 s
            quiet_since = time.monotonic()
        last = now


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn, then wait for the device's queued work (CUDA runs asynchronously), so a trial times it all."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)
    return run


def _trial(fn: Callable[[], object], wait: float = 0.0) -> tuple[float, bool]:
    if wait:
        _wait_for_idle(wait)
    before = _cpu_ticks()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    after = _cpu_ticks()
    if before is None or after is None:
        return dt, True
    others = (after[0] - before[0]) - (after[1] - before[1])
    # Background daemons use ~1% of a core here; more than 5% of one core is another workload.
    return dt, others <= 2 + 0.05 * dt * os.sysconf("SC_CLK_TCK")


def time_alternating(fns: dict[str, Callable[[], object]], trials: int, max_trials: int,
                     wait: float = 0.0) -> dict[str, Timing]:
    """Best wall time of each fn, running them in turn; stop once each has `trials` quiet trials.
    wait: before each trial, wait up to this many seconds for other processes to leave the CPU."""
    results = {k: Timing(float("inf"), 0, 0) for k in fns}
    quiet_times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max_trials):
        for name, fn in fns.items():
            r = results[name]
            if r.quiet >= trials:
                continue
            dt, quiet = _trial(fn, wait)
            r.trials += 1
            if quiet:
                r.quiet += 1
                quiet_times[name].append(dt)
            r.seconds = min(quiet_times[name]) if quiet_times[name] else min(r.seconds, dt)
        if all(r.quiet >= trials for r in results.values()):
            break
    return results


# --- models and workloads -------------------------------------------------------------------------


def to_transformers(model: GPT2):
    """transformers' GPT2LMHeadModel holding a copy of model's weights (float32, eval)."""
    try:
        from transformers import GPT2Config as HFConfig
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise ImportError("the benchmark compares with transformers: pip install 'gpt2kit[bench]'") from None

    # The config.json save_pretrained would write, without bos/eos: both generators then make exactly
    # max_new_tokens, with no stop checks; no dropout.
    hf_cfg = HFConfig(**(model.config.to_hf() | {"bos_token_id": None, "eos_token_id": None,
                                                 "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    hf = GPT2LMHeadModel(hf_cfg)
    state = {k: v.float() for k, v in to_hf_state(model.state_dict(), model.config).items()}
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf.eval()


def ours_prefill(model: GPT2, ids: torch.Tensor) -> Callable[[], object]:
    def run():
        prefill(model, ids, None, KVCache.for_model(model, ids.shape[0], ids.shape[1]))
    return run


def hf_prefill(hf, ids: torch.Tensor) -> Callable[[], object]:
    def run():
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)
    return run


def ours_decode(model: GPT2, prompts: torch.Tensor, n: int, out: list | None = None) -> Callable[[], object]:
    settings = SamplingSettings(temperature=0, max_new_tokens=n, stop_token_ids=())

    def run():
        result = generate(model, prompts.tolist(), settings)
        if out is not None:
            out[:] = [c.tokens for c in result]
    return run


def hf_decode(hf, prompts: torch.Tensor, n: int, out: list | None = None) -> Callable[[], object]:
    def run():
        with torch.inference_mode():
            ids = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=n, pad_token_id=0)
        if out is not None:
            out[:] = ids[:, prompts.shape[1]:].tolist()
    return run


def weight_bytes_per_token(model: GPT2) -> int:
    """Bytes of weights one batch-1 decode step reads: every matrix once (wte as the LM head), and
    one row of wpe. Buffers count too: an int8 model's codes and scales are buffers (gpt2kit.quant)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    total = sum(p.numel() * p.element_size() for name, p in tensors if name != "wpe.weight")
    return total + model.wpe.weight[0].numel() * model.wpe.weight.element_size()


def memory_bandwidth(trials: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes/s of a 1 GiB float32 sum on the device (CPU: with the current thread count)."""
    device = torch.device(device)
    x = torch.ones(2**28, device=device)
    fn = synced(lambda: x.sum(), device)
    fn()
    best = min(_trial(fn)[0] for _ in range(trials))
    return x.numel() * 4 / best


def resolve_device(device: str | torch.device) -> torch.device:
    """The benchmark's device; ValueError naming it when it is unknown or absent here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: the benchmark runs on cpu or cuda")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def logprob_drift(model32: GPT2, model16: GPT2, ids: torch.Tensor) -> tuple[float, float]:
    """(mean |Δ logprob| of the text's next tokens, mean |Δ| over the whole vocab), bf16 vs fp32."""
    with torch.inference_mode():
        lp32 = torch.log_softmax(model32(ids).logits.float(), -1)[0, :-1]  # (T - 1, V)
        lp16 = torch.log_softmax(model16(ids).logits.float(), -1)[0, :-1]
    targets = ids[0, 1:, None]
    d_next = (lp32.gather(-1, targets) - lp16.gather(-1, targets)).abs().mean().item()
    return d_next, (lp32 - lp16).abs().mean().item()


# --- peak memory, in a fresh process ------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process. Not ru_maxrss: Linux carries that over from the
    parent across fork + exec, so a worker started by a big process would report the parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_worker(engine: str, dtype: str, T: int, n: int, threads: int, device: str = "cpu") -> None:
    """Build the model and run the workloads; print the peak memory above the post-import
    baseline: RSS on CPU, allocated GPU memory on cuda (where the model is built)."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if engine == "transformers":
        import transformers  # noqa: F401 - imported before the baseline, like gpt2kit's own modules
    baseline = _status_bytes("VmRSS") if dev.type == "cpu" else torch.cuda.memory_allocated(dev)
    torch.manual_seed(0)
    ids = torch.randint(0, 50257, (1, T), device=dev), torch.randint(0, 50257, (8, 16), device=dev)
    if engine == "gpt2kit" and dtype == "int8":
        model = _int8_model(GPT2Config(), dev)
        runs = [ours_prefill(model, ids[0]), ours_decode(model, ids[1], n)]
    elif engine == "gpt2kit":
        torch.set_default_dtype(getattr(torch, dtype))  # built in its dtype: no float32 copy on the way
        with dev:
            model = use_decode_layout(GPT2(GPT2Config()).eval())
        torch.set_default_dtype(torch.float32)
        runs = [ours_prefill(model, ids[0]), ours_decode(model, ids[1], n)]
    else:
        from transformers import GPT2Config as HFConfig
        from transformers import GPT2LMHeadModel

        with dev:
            hf = GPT2LMHeadModel(HFConfig(bos_token_id=None, eos_token_id=None)).eval()
        runs = [hf_prefill(hf, ids[0]), hf_decode(hf, ids[1], n)]
    for run in runs:
        synced(run, dev)()
    peak = _status_bytes("VmHWM") if dev.type == "cpu" else torch.cuda.max_memory_allocated(dev)
    print(json.dumps({"peak_above_baseline": peak - baseline}))


def _int8_model(config: GPT2Config, device: torch.device) -> GPT2:
    """A random int8 model built as loading a quantized checkpoint builds it (int8 modules on the meta
    device, then filled), so no float32 copy ever exists: the memory a user of `gpt2kit quantize` sees."""
    with torch.device("meta"):
        model = quantized_skeleton(GPT2(config), lm_head=True)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.dtype == torch.int8:
                t.random_(-127, 128)
            elif name.endswith(".scale"):
                t.fill_(0.02 * 3 / 127)  # N(0, 0.02) weights reach ~3 sigma
            elif ".ln_" in name or name.startswith("ln_f"):
                t.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                t.normal_(0, 0.01 if name.startswith("wpe") else 0.02)
    return model.eval()


def peak_memory(engine: str, dtype: str, T: int, n: int, threads: int,
                device: torch.device | str = "cpu") -> float | None:
    """MiB of peak memory above the post-import baseline, in a fresh process: RSS on CPU (None
    where it cannot be measured), allocated GPU memory on cuda."""
    if torch.device(device).type == "cpu" and not sys.platform.startswith("linux"):
        return None
    cmd = [sys.executable, "-m", "gpt2kit.bench", "--_memory-worker", engine, dtype, str(T), str(n),
           str(threads), str(device)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"memory worker failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_above_baseline"] / 2**20


# --- the run ---------------------------------------------------------------------------------------


def machine(device: torch.device | str = "cpu") -> dict[str, object]:
    info = cpu_info()
    import transformers

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else info["cpu"]
    return {**info, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "device": name, "device_type": device.type}


def run(quick: bool = False, threads: int | None = None, memory: bool = True, wait: float = 0.0,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
        device: str | torch.device = "cpu", config: GPT2Config | None = None, quantize: str | None = None) -> dict:
    """Run the benchmark; returns the results (also what `format_table` prints). wait: seconds to
    wait, before each trial, for other processes to leave the CPU (for shared machines). device:
    cpu or cuda (on cuda each trial ends with a synchronize; memory is the peak allocated).
    config: another model than gpt2 124M (the tests run a tiny one). quantize: "int8" adds gpt2kit
    with int8 weights (gpt2kit.quant, LM head included) as a third column."""
    if quantize is not None:
        check_scheme(quantize)
    device = resolve_device(device)
    config = config or GPT2Config()
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    T, n, trials, max_trials = (256, 32, 2, 4) if quick else (1024, 128, 3, 6)
    T, n = min(T, config.n_ctx), min(n, config.n_ctx - 16)
    info = machine(device)
    log(f"gpt2kit bench: {info['device']}, {threads} threads; prefill T={T}, decode {n} new tokens")
    torch.manual_seed(0)
    ours32 = GPT2(config).eval()
    hf = to_transformers(ours32).to(device)
    ours16 = GPT2(config).eval()
    ours16.load_state_dict(ours32.state_dict())
    ours32, ours16 = ours32.to(device), ours16.to(device, torch.bfloat16)
    ours8 = None
    if quantize is not None:
        ours8 = GPT2(config).eval()
        ours8.load_state_dict(ours32.state_dict())
        ours8 = quantize_model(ours8.to(device), quantize, lm_head=True)
    for model in (ours32, ours16):  # what generate does first; here so that prefill has it too
        use_decode_layout(model)
    engines = {"transformers/float32": (hf, hf_prefill, hf_decode),
               "gpt2kit/float32": (ours32, ours_prefill, ours_decode),
               "gpt2kit/bfloat16": (ours16, ours_prefill, ours_decode)}
    if ours8 is not None:
        engines["gpt2kit/int8"] = (ours8, ours_prefill, ours_decode)
    g = torch.Generator().manual_seed(1)
    V = config.n_vocab
    long_prompt = torch.randint(0, V, (1, T), generator=g).to(device)
    prompts = {B: torch.randint(0, V, (B, 16), generator=g).to(device) for B in (1, 8)}

    results: dict[str, dict] = {"machine": info, "T": T, "new_tokens": n, "tok_s": {}, "quiet": {}}
    greedy: dict[str, list] = {"transformers/float32": [], "gpt2kit/float32": []}
    for wl, tokens in (("prefill", T), ("decode_b1", n), ("decode_b8", 8 * n)):
        log(f"  {wl} ...")
        fns = {}
        for name, (model, make_prefill, make_decode) in engines.items():
            if wl == "prefill":
                fns[name] = make_prefill(model, long_prompt)
            else:
                B = 1 if wl == "decode_b1" else 8
                fns[name] = make_decode(model, prompts[B], n, greedy.get(name) if B == 1 else None)
            fns[name] = synced(fns[name], device)
            fns[name]()  # warm-up (and, at batch 1, the greedy tokens)
        timings = time_alternating(fns, trials, max_trials, wait)
        results["tok_s"][wl] = {k: tokens / t.seconds for k, t in timings.items()}
        results["quiet"][wl] = {k: f"{t.quiet}/{t.trials}" for k, t in timings.items()}
        log("    " + ", ".join(f"{k} {v:.1f} tok/s ({results['quiet'][wl][k]} quiet)"
                               for k, v in results["tok_s"][wl].items()))
    results["greedy_identical"] = greedy["transformers/float32"] == greedy["gpt2kit/float32"]

    ids = torch.tensor([Tokenizer.default().encode(TEXT * 8)[: min(512, config.n_ctx)]], device=device)
    results["dlogprob_next"], results["dlogprob_vocab"] = logprob_drift(ours32, ours16, ids)
    bw = memory_bandwidth(device=device)
    results["bandwidth_GBs"] = bw / 1e9
    results["limit_tok_s"] = {"float32": bw / weight_bytes_per_token(ours32),
                              "bfloat16": bw / weight_bytes_per_token(ours16)}
    results["bytes_per_token"] = {"float32": weight_bytes_per_token(ours32),
                                  "bfloat16": weight_bytes_per_token(ours16)}
    if ours8 is not None:
        results["limit_tok_s"]["int8"] = bw / weight_bytes_per_token(ours8)
        results["bytes_per_token"]["int8"] = weight_bytes_per_token(ours8)
        results["weight_MB"] = {"float32": weight_bytes(ours32) / 1e6, "int8": weight_bytes(ours8) / 1e6}
        results["dlogprob_int8_next"], results["dlogprob_int8_vocab"] = logprob_drift(ours32, ours8, ids)
        results["int8_kernels"] = chosen()
    if memory:
        log("  peak memory (fresh processes) ...")
        results["peak_MiB"] = {
            "transformers/float32": peak_memory("transformers", "float32", T, n, threads, device),
            "gpt2kit/float32": peak_memory("gpt2kit", "float32", T, n, threads, device),
            "gpt2kit/bfloat16": peak_memory("gpt2kit", "bfloat16", T, n, threads, device),
        }
        if ours8 is not None:
            results["peak_MiB"]["gpt2kit/int8"] = peak_memory("gpt2kit", "int8", T, n, threads, device)
    return results


def format_table(r: dict) -> str:
    m = r["machine"]
    ref, cols = "transformers/float32", ("gpt2kit/float32", "gpt2kit/bfloat16")
    on_gpu = m.get("device_type") == "cuda"
    lines = [
        (f"device: {m['device']} (cuda); " if on_gpu else "")
        + f"machine: {m['cpu']}, {m['cores']} cores ({' '.join(m['isa'])}); {m['threads']} threads; "
        f"torch {m['torch']}, transformers {m['transformers']}, python {m['python']}",
        "model: GPT-2 124M, random weights (the same in both); eager; greedy; best of the quiet trials; "
        "gpt2kit with its defaults (prepacked weights where they help: float32 batches, bfloat16)",
        "",
        "| workload | transformers fp32 | gpt2kit fp32 | ratio | gpt2kit bf16 | ratio | quiet trials |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    names = {"prefill": f"prefill tok/s (T={r['T']})", "decode_b1": f"decode tok/s, batch 1 ({r['new_tokens']} new)",
             "decode_b8": f"decode tok/s, batch 8 ({r['new_tokens']} new)"}
    i8 = "gpt2kit/int8" if "gpt2kit/int8" in r["tok_s"]["prefill"] else None
    if i8:  # the int8 column goes in before the quiet-trials one
        lines[-2] = lines[-2].replace(" | quiet trials |", " | gpt2kit int8 | ratio | quiet trials |")
        lines[-1] = lines[-1].replace("--:|---|", "--:|--:|--:|---|")
    for wl, label in names.items():
        v = r["tok_s"][wl]
        q = r["quiet"][wl]
        extra = f"{v[i8]:.1f} | {v[i8] / v[ref]:.2f}x | " if i8 else ""
        lines.append(f"| {label} | {v[ref]:.1f} | {v[cols[0]]:.1f} | {v[cols[0]] / v[ref]:.2f}x | "
                     f"{v[cols[1]]:.1f} | {v[cols[1]] / v[ref]:.2f}x | {extra}{q[ref]}, {q[cols[0]]}, {q[cols[1]]}"
                     f"{', ' + q[i8] if i8 else ''} |")
    if r.get("peak_MiB"):
        p = r["peak_MiB"]
        what = "peak GPU memory allocated" if on_gpu else "peak RSS above baseline"
        extra = f"{p[i8]:.0f} | {p[i8] / p[ref]:.2f}x | " if i8 and p.get(i8) is not None else ""
        lines.append(f"| {what}, MiB (lower is better) | {p[ref]:.0f} | {p[cols[0]]:.0f} | "
                     f"{p[cols[0]] / p[ref]:.2f}x | {p[cols[1]]:.0f} | {p[cols[1]] / p[ref]:.2f}x | {extra}|")
    if i8:
        w = r["weight_MB"]
        lines.append(f"| weight memory, MB (lower is better) | {w['float32']:.0f} | {w['float32']:.0f} | 1.00x | "
                     f"{w['float32'] / 2:.0f} | 0.50x | {w['int8']:.0f} | {w['int8'] / w['float32']:.2f}x | |")
    lim, bpt = r["limit_tok_s"], r["bytes_per_token"]
    b1 = r["tok_s"]["decode_b1"]
    lines += [
        "",
        f"physical limit, batch-1 decode: weights read per token / bandwidth ({r['bandwidth_GBs']:.1f} GB/s, "
        f"1 GiB float32 sum, {'GPU' if on_gpu else 'CPU'}): "
        f"float32 {bpt['float32'] / 1e6:.0f} MB -> {lim['float32']:.1f} tok/s "
        f"(gpt2kit at {b1[cols[0]] / lim['float32']:.0%}, transformers at {b1[ref] / lim['float32']:.0%}); "
        f"bfloat16 {bpt['bfloat16'] / 1e6:.0f} MB -> {lim['bfloat16']:.1f} tok/s "
        f"(gpt2kit at {b1[cols[1]] / lim['bfloat16']:.0%})",
        f"bfloat16 vs float32 on the same text (512 tokens): mean |Δ logprob| {r['dlogprob_next']:.2e} "
        f"(next tokens), {r['dlogprob_vocab']:.2e} (whole vocabulary)",
        f"greedy batch-1 tokens identical to transformers: {'yes' if r['greedy_identical'] else 'NO'}",
        "targets (gpt2kit / transformers fp32): " + ", ".join(
            f"{wl} {dt} {r['tok_s'][wl][f'gpt2kit/{dt}'] / r['tok_s'][wl][ref]:.2f}x "
            f"{'>=' if r['tok_s'][wl][f'gpt2kit/{dt}'] / r['tok_s'][wl][ref] >= goal else '<'} {goal}"
            for (wl, dt), goal in TARGETS.items() if f"gpt2kit/{dt}" in r["tok_s"][wl]),
    ]
    if i8:
        w = r["weight_MB"]
        lines += [
            f"int8 (weight-only, LM head included): physical limit {bpt['int8'] / 1e6:.0f} MB per token -> "
            f"{lim['int8']:.1f} tok/s (gpt2kit int8 at {b1[i8] / lim['int8']:.0%}); weight memory "
            f"{w['int8'] / w['float32']:.0%} of float32 ({'<=' if w['int8'] <= 0.30 * w['float32'] else '>'} 30%); "
            f"kernels {r['int8_kernels']}",
            f"int8 vs float32 on the same text (random weights): mean |Δ logprob| {r['dlogprob_int8_next']:.2e} "
            f"(next tokens), {r['dlogprob_int8_vocab']:.2e} (whole vocabulary); the quality gate on a trained "
            "model is in docs/quantization.md",
        ]
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    if getattr(args, "_memory_worker", None):
        engine, dtype, T, n, threads, device = args._memory_worker
        _memory_worker(engine, dtype, int(T), int(n), int(threads), device)
        return 0
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    size = getattr(args, "size", "gpt2")
    config = GPT2Config.from_name(size)  # a name that is not a preset: ValueError listing them
    results = run(quick=args.quick, threads=args.threads, memory=not args.no_memory and size == "gpt2",
                  wait=args.wait, device=getattr(args, "device", "cpu"), quantize=getattr(args, "quantize", None),
                  config=None if size == "gpt2" else config)
    print(format_table(results))
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=2))
    return 0

