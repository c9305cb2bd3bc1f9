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

This module measures; the trials are timed by timing.py and the results printed by report.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Callable

import torch

from gpt2kit._io import atomic_write_text
from gpt2kit.bench.machine import cpu_info
from gpt2kit.bench.report import format_table
from gpt2kit.bench.timing import synced, time_alternating, trial
from gpt2kit.checkpoint.keymap import to_hf_state
from gpt2kit.config import GPT2Config
from gpt2kit.decode import prefill, use_decode_layout
from gpt2kit.decode.int8 import chosen
from gpt2kit.decode.int8act import chosen as int8act_chosen
from gpt2kit.generate import generate
from gpt2kit.kv_cache import KVCache
from gpt2kit.model import GPT2
from gpt2kit.quant import check_scheme, quantize_model, quantized_skeleton, set_activations, weight_bytes
from gpt2kit.sampling import SamplingSettings
from gpt2kit.tokenizer import Tokenizer

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. "
)


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
    """Bytes/s of a 1 GiB float32 sum on the device (CPU: with the current thread count, on huge pages
    where decode/layout.py puts a model's weights, so the figure is what the decode step can stream)."""
    device = torch.device(device)
    x = torch.ones(2**28, device=device)
    if device.type == "cpu":
        from gpt2kit.decode.layout import huge_pages_available, on_huge_pages

        if huge_pages_available():
            x = on_huge_pages(x)
    fn = synced(lambda: x.sum(), device)
    fn()
    best = min(trial(fn)[0] for _ in range(trials))
    return x.numel() * 4 / best


def bench_device(device: str | torch.device) -> torch.device:
    """The benchmark's device, cpu or cuda, a bare cuda given its index (the one the table names);
    ValueError naming it when it is unknown or absent here (devices.resolve_device: any device a
    model may load onto)."""
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
    cmd = [sys.executable, "-m", "gpt2kit", "bench", "--_memory-worker", engine, dtype, str(T), str(n),
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
        device: str | torch.device = "cpu", config: GPT2Config | None = None, quantize: str | None = None,
        int8_activations: bool = False) -> dict:
    """Run the benchmark; returns the results (also what `format_table` prints). wait: seconds to
    wait, before each trial, for other processes to leave the CPU (for shared machines). device:
    cpu or cuda (on cuda each trial ends with a synchronize; memory is the peak allocated).
    config: another model than gpt2 124M (the tests run a tiny one). quantize: "int8" adds gpt2kit
    with int8 weights (gpt2kit.quant, LM head included) as a third column; int8_activations: that
    column with int8 activations too (gpt2kit.decode.int8act; speed only: no quality gate on random weights)."""
    if quantize is not None:
        check_scheme(quantize)
    device = bench_device(device)
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
        if int8_activations:
            set_activations(ours8, "int8")
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
        results["int8_kernels"] = int8act_chosen() if int8_activations else chosen()
        results["int8_activations"] = int8_activations
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


def measure_from_args(args: argparse.Namespace) -> int:
    """The measurement (or, with --_memory-worker, one worker's part of it) for checked arguments; the table
    printed, the JSON written."""
    if getattr(args, "_memory_worker", None):
        engine, dtype, T, n, threads, device = args._memory_worker
        _memory_worker(engine, dtype, int(T), int(n), int(threads), device)
        return 0
    size = getattr(args, "size", "gpt2")
    config = GPT2Config.from_name(size)  # a name that is not a preset: ValueError listing them
    results = run(quick=args.quick, threads=args.threads, memory=not args.no_memory and size == "gpt2",
                  wait=args.wait, device=getattr(args, "device", "cpu"), quantize=getattr(args, "quantize", None),
                  config=None if size == "gpt2" else config,
                  int8_activations=getattr(args, "int8_activations", False))
    print(format_table(results))
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=2))
    return 0

