"""What `gpt2kit bench` measures: the workloads of each library, the weights a token reads, the memory
bandwidth, bfloat16's drift and peak memory in a fresh process (runner.py runs them in turn).

Both libraries run the same random-weight model (gpt2kit's init; transformers gets a copy of the
weights), eagerly, with default settings and the same thread count, on the same prompts:

* prefill: tokens/s encoding a T-token prompt into the KV cache (logits of the last position only,
  as both generators do: gpt2kit's ``prefill``, transformers' ``logits_to_keep=1``);
* decode: tokens/s of greedy generation of n new tokens after a 16-token prompt, at batch 1 and
  batch 8, through each library's own generate (prefill included, no stop token);
* peak memory: the peak RSS of a fresh process (VmHWM), above its RSS after imports, while it
  builds gpt2 124M and runs the prefill and the batch-8 decode (tracemalloc cannot see PyTorch's
  allocator); on cuda, the GPU memory allocated;
* the physical limit of batch-1 decode: the bytes of weights each token reads, divided by the
  memory bandwidth measured in the same run (a 1 GiB float32 sum).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from collections.abc import Callable

import torch

from gpt2kit.bench.timing import synced, trial
from gpt2kit.checkpoint.keymap import to_hf_state
from gpt2kit.config import GPT2Config
from gpt2kit.decode import kernel_choice, prefill, use_decode_layout
from gpt2kit.decode.layout import huge_pages_available, on_huge_pages
from gpt2kit.generation import generate
from gpt2kit.kv_cache import KVCache
from gpt2kit.machine import cpu_info
from gpt2kit.model import GPT2
from gpt2kit.quant.modules import quantized_skeleton
from gpt2kit.sampling import SamplingSettings

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
    one row of wpe. Buffers count too: an int8 model's codes and scales are buffers (gpt2kit.quant.modules)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    total = sum(p.numel() * p.element_size() for name, p in tensors if name != "wpe.weight")
    return total + model.wpe.weight[0].numel() * model.wpe.weight.element_size()


def memory_bandwidth(trials: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes/s of a 1 GiB float32 sum on the device (CPU: with the current thread count, on huge pages
    where decode/layout.py puts a model's weights, so the figure is what the decode step can stream)."""
    device = torch.device(device)
    n = 2**28
    if device.type == "cpu":
        # filled in place on huge pages: no second GiB written first on ordinary pages
        x = on_huge_pages(torch.ones(1).expand(n)) if huge_pages_available() else torch.ones(n)
    else:
        x = torch.ones(n, device=device)
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


def memory_worker(engine: str, dtype: str, T: int, n: int, threads: int, device: str = "cpu") -> None:
    """Build the model and run the workloads, a line of progress on stderr after each; print the peak
    memory above the post-import baseline: RSS on CPU, allocated GPU memory on cuda (where the model is
    built)."""
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
    print("model built", file=sys.stderr, flush=True)
    for what, run in zip((f"prefill T={T}", f"batch-8 decode, {n} new tokens"), runs, strict=True):
        synced(run, dev)()
        print(f"{what} done", file=sys.stderr, flush=True)
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
                device: torch.device | str = "cpu", log: Callable[[str], None] | None = None) -> float | None:
    """MiB of peak memory above the post-import baseline, in a fresh process: RSS on CPU (None
    where it cannot be measured), allocated GPU memory on cuda. log: each line the process writes to
    stderr (its progress), as it comes."""
    if torch.device(device).type == "cpu" and not sys.platform.startswith("linux"):
        return None
    cmd = [sys.executable, "-m", "gpt2kit", "bench", "--_memory-worker", engine, dtype, str(T), str(n),
           str(threads), str(device)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        err = []
        for line in proc.stderr:  # stdout is one short line: it cannot fill its pipe meanwhile
            err.append(line.rstrip())
            if log is not None and err[-1]:
                log(err[-1])
        out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker failed: {[e for e in err if e][-1:]}")
    return json.loads(out.strip().splitlines()[-1])["peak_above_baseline"] / 2**20


def machine(device: torch.device | str = "cpu") -> dict[str, object]:
    info = cpu_info()
    import transformers

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else info["cpu"]
    return {**info, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "device": name, "device_type": device.type,
            "kernel_note": kernel_choice.unmeasured() if device.type == "cpu" else None}
