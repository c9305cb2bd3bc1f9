"""gpt2kit against the engines people pick for CPU speed: CTranslate2, ONNX Runtime and llama.cpp.

    pip install 'gpt2kit[peers]'        # ctranslate2, onnxruntime, onnx (llama-cpp-python: see below)
    python benchmarks/bench_peers.py [--threads 2] [--trials 3] [--new-tokens 128] [--json FILE]

One random-weight GPT-2 124M (gpt2kit's init, seed 0) is saved by gpt2kit as an HF directory, and
each peer converts it with its own tools:

  gpt2kit-a8    gpt2kit's opt-in int8-activation mode (int8 weights and activations, per-row scales:
                gpt2kit.decode.int8act), int8 only; on random weights, so without its quality gate
                (speed only; the gate on a trained model is in docs/quantization.md)

  ctranslate2   ct2-transformers-converter (int8 and float32 models; compute_type int8 / float32)
  onnxruntime   torch.onnx.export of transformers' GPT2LMHeadModel with its key/value cache as
                inputs and outputs (float32), and onnxruntime.quantization.quantize_dynamic (int8:
                int8 weights and int8 activations with dynamic per-row scales, as ORT does it)
  llama.cpp     llama-cpp-python, only where already installed: GGUF F32 / Q8_0 written by its
                convert_hf_to_gguf.py, found via $LLAMA_CPP_DIR (a llama.cpp checkout); otherwise
                skipped with a note (pip builds it from source, ~15 minutes on 2 idle cores)

Each engine runs in a process of its own with the same thread count; the main process alternates
trials between them (one trial of each in turn) and keeps the best of N. Workloads: greedy decode of
--new-tokens tokens after a 16-token prompt at batch 1 and batch 8, in float32 and int8, and a
prefill of --prefill tokens (the prompt's forward pass up to the first new token). The table gives
tok/s, gpt2kit / the best peer of the same weight dtype, and the physical limit of batch-1 decode:
the bytes of weights a token reads over the memory bandwidth measured in the same run (a 1 GiB
float32 sum). The machine is named through gpt2kit.machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("decode_b1", "decode_b8", "prefill")
DTYPES = ("float32", "int8")
ENGINES = ("gpt2kit", "gpt2kit-a8", "ctranslate2", "onnxruntime", "llama.cpp")
ONLY = {"gpt2kit-a8": ("int8",)}  # engines that run some dtypes only (the others are left out, not skipped)
PROMPT = 16


# --- what is installed, and the conversions ---------------------------------------------------------


def missing(engine: str) -> str | None:
    """Why `engine` cannot run here, or None."""
    import importlib.util

    need = {"ctranslate2": ["ctranslate2"], "onnxruntime": ["onnxruntime", "onnx", "transformers"],
            "llama.cpp": ["llama_cpp"], "gpt2kit": [], "gpt2kit-a8": []}[engine]
    absent = [m for m in need if importlib.util.find_spec(m) is None]
    if absent:
        hint = ("pip install llama-cpp-python (builds from source: ~15 minutes on 2 idle cores)"
                if engine == "llama.cpp" else "pip install 'gpt2kit[peers]'")
        return f"{', '.join(absent)} not installed ({hint})"
    if engine == "llama.cpp" and not _gguf_converter():
        return "no convert_hf_to_gguf.py (set LLAMA_CPP_DIR to a llama.cpp checkout)"
    return None


def _gguf_converter() -> Path | None:
    root = os.environ.get("LLAMA_CPP_DIR")
    script = Path(root, "convert_hf_to_gguf.py") if root else None
    return script if script and script.is_file() else None


def save_checkpoint(directory: Path, size: str = "gpt2") -> Path:
    """The random-weight model every engine runs, written by gpt2kit (an HF directory)."""
    import torch

    from gpt2kit import GPT2, GPT2Config, save_model

    torch.manual_seed(0)
    save_model(GPT2(GPT2Config.from_name(size)).eval(), directory)
    return directory


def convert(engine: str, dtype: str, hf_dir: Path, work: Path) -> Path:
    """`hf_dir` converted by `engine`'s own tools for `dtype`; the path the engine loads."""
    out = work / f"{engine}-{dtype}"
    if out.exists():
        return out
    if engine in ("gpt2kit", "gpt2kit-a8"):
        return hf_dir
    if engine == "ctranslate2":
        tool = shutil.which("ct2-transformers-converter") or str(Path(sys.executable).with_name(
            "ct2-transformers-converter"))
        _check([tool, "--model", str(hf_dir), "--output_dir", str(out), "--quantization", dtype])
    elif engine == "onnxruntime":
        f32 = work / "onnxruntime-float32"
        if not f32.exists():
            _check([sys.executable, __file__, "--_export-onnx", str(hf_dir), str(f32)])
        if dtype == "int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            tmp = work / "onnxruntime-int8.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            quantize_dynamic(str(f32 / "model.onnx"), str(tmp / "model.onnx"), weight_type=QuantType.QInt8)
            tmp.rename(out)
    elif engine == "llama.cpp":
        out.mkdir()
        _check([sys.executable, str(_gguf_converter()), str(hf_dir), "--outfile", str(out / "model.gguf"),
                "--outtype", {"float32": "f32", "int8": "q8_0"}[dtype]])
    return out


def _check(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no message"])[-1][:300]
        raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:2])} failed: {tail}")


def export_onnx(hf_dir: Path, out: Path) -> None:
    """transformers' GPT2LMHeadModel as ONNX: inputs input_ids (B, T), attention_mask (B, P + T),
    past (L, 2, B, nh, P, hs); outputs the last position's logits (B, V) and present (L, 2, B, nh, P + T, hs)."""
    import torch
    from transformers import DynamicCache, GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    cfg = hf.config
    L, nh, hs = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf  # a submodule: its weights become the graph's initializers

        def forward(self, input_ids, attention_mask, past):
            P = past.shape[4]
            cache = DynamicCache()
            for i in range(L):
                cache.update(past[i, 0], past[i, 1], i)
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, P:]  # (B, T)
            r = self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1)
            kv = r.past_key_values
            present = torch.stack([torch.stack([kv.layers[i].keys, kv.layers[i].values]) for i in range(L)])
            return r.logits[:, -1], present

    B, T, P = 2, 3, 4
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.ones(B, P + T, dtype=torch.long)
    past = torch.zeros(L, 2, B, nh, P, hs)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with torch.no_grad():
        torch.onnx.export(Step(), (ids, mask, past), str(tmp / "model.onnx"), dynamo=False,
                          input_names=["input_ids", "attention_mask", "past"], output_names=["logits", "present"],
                          dynamic_axes={"input_ids": {0: "B", 1: "T"}, "attention_mask": {0: "B", 1: "PT"},
                                        "past": {2: "B", 4: "P"}, "logits": {0: "B"}, "present": {2: "B", 4: "PT"}})
    (tmp / "shape.json").write_text(json.dumps({"L": L, "nh": nh, "hs": hs}))
    tmp.rename(out)


# --- the engines, each in its own worker process -----------------------------------------------------


class Engine:
    """One engine's model, and the three workloads on it: prompts are lists of token ids."""

    def decode(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        raise NotImplementedError

    def prefill(self, prompt: list[int]) -> None:
        raise NotImplementedError


class Gpt2kit(Engine):
    def __init__(self, path: Path, dtype: str, threads: int):
        import torch

        from gpt2kit import load_model
        from gpt2kit.quant.modules import quantize_model

        torch.set_num_threads(threads)
        self.model = load_model(path)
        if dtype == "int8":
            self.model = quantize_model(self.model, "int8")

    def decode(self, prompts, n):
        from gpt2kit.generation import SamplingSettings, generate

        settings = SamplingSettings(temperature=0, max_new_tokens=n, stop_token_ids=())
        return [c.tokens for c in generate(self.model, prompts, settings)]

    def prefill(self, prompt):
        import torch

        from gpt2kit.decode import prefill
        from gpt2kit.kv_cache import KVCache

        ids = torch.tensor([prompt])
        with torch.inference_mode():
            prefill(self.model, ids, None, KVCache.for_model(self.model, 1, ids.shape[1]))


class Gpt2kitA8(Gpt2kit):
    """gpt2kit int8 with int8 activations (set directly: random weights have no quality gate to pass)."""

    def __init__(self, path: Path, dtype: str, threads: int):
        from gpt2kit.quant.modules import set_activations

        super().__init__(path, dtype, threads)
        set_activations(self.model, "int8")


class CTranslate2(Engine):
    def __init__(self, path: Path, dtype: str, threads: int):
        import ctranslate2

        self.gen = ctranslate2.Generator(str(path), device="cpu", compute_type=dtype, intra_threads=threads,
                                         inter_threads=1)
        self.vocab = json.loads((path / "vocabulary.json").read_text())

    def _generate(self, prompts, n):
        return self.gen.generate_batch([[self.vocab[i] for i in p] for p in prompts], max_length=n, min_length=n,
                                       sampling_topk=1, include_prompt_in_result=False)

    def decode(self, prompts, n):
        return [r.sequences_ids[0] for r in self._generate(prompts, n)]

    def prefill(self, prompt):
        self._generate([prompt], 1)  # the prompt's forward pass, then one step: its first token


class OnnxRuntime(Engine):
    def __init__(self, path: Path, dtype: str, threads: int):
        import numpy as np
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        self.sess = ort.InferenceSession(str(path / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        shape = json.loads((path.parent / "onnxruntime-float32" / "shape.json").read_text())
        self.L, self.nh, self.hs, self.np = shape["L"], shape["nh"], shape["hs"], np

    def _run(self, ids, past):
        np = self.np
        B, P = ids.shape[0], past.shape[4]
        mask = np.ones((B, P + ids.shape[1]), dtype=np.int64)
        return self.sess.run(None, {"input_ids": ids, "attention_mask": mask, "past": past})

    def decode(self, prompts, n):
        np = self.np
        ids = np.array(prompts, dtype=np.int64)
        past = np.zeros((self.L, 2, ids.shape[0], self.nh, 0, self.hs), dtype=np.float32)
        out = []
        for _ in range(n):
            logits, past = self._run(ids, past)
            ids = logits.argmax(-1)[:, None].astype(np.int64)
            out.append(ids[:, 0])
        return np.stack(out, 1).tolist()

    def prefill(self, prompt):
        np = self.np
        past = np.zeros((self.L, 2, 1, self.nh, 0, self.hs), dtype=np.float32)
        self._run(np.array([prompt], dtype=np.int64), past)


class LlamaCpp(Engine):
    def __init__(self, path: Path, dtype: str, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(str(path / "model.gguf"), n_ctx=1024, n_batch=1024, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def decode(self, prompts, n):
        out = []
        for p in prompts:  # llama-cpp-python's high-level API decodes one sequence at a time
            self.llm.reset()
            toks = []
            for t in self.llm.generate(p, top_k=1, temp=0.0, reset=True):
                toks.append(t)
                if len(toks) == n:
                    break
            out.append(toks)
        return out

    def prefill(self, prompt):
        self.llm.reset()
        self.llm.eval(prompt)


CLASSES = {"gpt2kit": Gpt2kit, "gpt2kit-a8": Gpt2kitA8, "ctranslate2": CTranslate2, "onnxruntime": OnnxRuntime,
           "llama.cpp": LlamaCpp}


def _worker(engine: str, path: str, dtype: str, threads: int) -> None:
    """Serve trials on stdin: "WORKLOAD N T" runs one and answers {"seconds": s} on stdout."""
    eng = CLASSES[engine](Path(path), dtype, threads)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        wl, n, T = line.split()
        n, T = int(n), int(T)
        prompts = [[(97 * b + 13 * i) % 50000 for i in range(PROMPT)] for b in range(8 if wl == "decode_b8" else 1)]
        t0 = time.perf_counter()
        if wl == "prefill":
            eng.prefill([(31 * i + 7) % 50000 for i in range(T)])
        else:
            eng.decode(prompts, n)
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


class Worker:
    def __init__(self, engine: str, path: Path, dtype: str, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.name = f"{engine}/{dtype}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--_worker", engine, str(path), dtype, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"{self.name} worker failed: {(err or ['no message'])[-1][:300]}")
        return json.loads(line)

    def trial(self, wl: str, n: int, T: int) -> float:
        self.proc.stdin.write(f"{wl} {n} {T}\n")
        self.proc.stdin.flush()
        return self._read()["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- the run ---------------------------------------------------------------------------------------


def run(threads: int = 2, trials: int = 3, new_tokens: int = 128, prefill: int = 1024, size: str = "gpt2",
        engines: tuple[str, ...] = ENGINES, workloads: tuple[str, ...] = WORKLOADS, dtypes: tuple[str, ...] = DTYPES,
        work: Path | None = None, bandwidth: bool = True, log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Measure; returns {"machine", "tok_s": {workload: {engine/dtype: tok/s}}, "skipped", ...}."""
    if threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {threads}")
    if trials < 1:
        raise ValueError(f"--trials must be an integer >= 1, got {trials}")
    from gpt2kit import GPT2Config
    from gpt2kit.machine import cpu_info, describe_cpu

    cfg = GPT2Config.from_name(size)
    prefill = min(prefill, cfg.n_ctx)
    new_tokens = min(new_tokens, cfg.n_ctx - PROMPT)
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="gpt2kit-peers-")) if own else Path(work)
    results: dict = {"machine": {**cpu_info(), "describe": describe_cpu(), "threads": threads}, "size": size,
                     "trials": trials, "new_tokens": new_tokens, "prefill": prefill, "tok_s": {}, "skipped": {}}
    try:
        hf_dir = work / "checkpoint"
        if not hf_dir.exists():
            save_checkpoint(hf_dir, size)
        for dtype in dtypes:
            workers = []
            for engine in engines:
                if dtype not in ONLY.get(engine, (dtype,)):
                    continue
                why = missing(engine)
                if why is None:
                    try:
                        workers.append(Worker(engine, convert(engine, dtype, hf_dir, work), dtype, threads))
                    except (RuntimeError, OSError, ValueError) as e:
                        why = str(e)
                if why is not None:
                    results["skipped"][f"{engine}/{dtype}"] = why
                    log(f"  {engine}/{dtype}: skipped ({why})")
            try:
                for wl in workloads:
                    n = {"decode_b1": new_tokens, "decode_b8": new_tokens, "prefill": 1}[wl]
                    tokens = {"decode_b1": new_tokens, "decode_b8": 8 * new_tokens, "prefill": prefill}[wl]
                    for w in workers:
                        w.trial(wl, n, prefill)  # warm-up
                    best = {w.name: float("inf") for w in workers}
                    for _ in range(trials):  # alternating: one trial of each engine in turn
                        for w in workers:
                            best[w.name] = min(best[w.name], w.trial(wl, n, prefill))
                    got = {k: tokens / s for k, s in best.items()}
                    results["tok_s"].setdefault(wl, {}).update(got)
                    log(f"  {wl} {dtype}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in got.items()))
            finally:
                for w in workers:
                    w.close()
        if bandwidth:
            results.update(_limit(hf_dir, threads))
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _limit(hf_dir: Path, threads: int) -> dict:
    import torch

    from gpt2kit import load_model
    from gpt2kit.bench.core import memory_bandwidth, weight_bytes_per_token
    from gpt2kit.quant.modules import quantize_model

    torch.set_num_threads(threads)
    model = load_model(hf_dir)
    b32 = weight_bytes_per_token(model)
    b8 = weight_bytes_per_token(quantize_model(model, "int8"))
    bw = memory_bandwidth()
    return {"bandwidth_GBs": bw / 1e9, "limit_tok_s": {"float32": bw / b32, "int8": bw / b8},
            "bytes_per_token": {"float32": b32, "int8": b8}}


def format_table(r: dict) -> str:
    m = r["machine"]
    lines = [f"machine: {m['describe']}; {m['threads']} threads each; GPT-2 {r['size']}, random weights (seed 0), "
             f"best of {r['trials']} alternating trials, each engine in its own process", "",
             "| workload (tok/s) | gpt2kit | gpt2kit int8-act. | ctranslate2 | onnxruntime | llama.cpp "
             "| gpt2kit / best peer | gpt2kit int8-act. / best peer |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    n = r["new_tokens"]
    names = {"decode_b1": f"decode batch 1 ({n} new)", "decode_b8": f"decode batch 8 ({n} new)",
             "prefill": f"prefill {r['prefill']} tokens"}
    for wl, label in names.items():
        for dtype in DTYPES:
            v = r["tok_s"].get(wl, {})
            if f"gpt2kit/{dtype}" not in v and not any(k.endswith(dtype) for k in v):
                continue
            cells = [f"{v[f'{e}/{dtype}']:.1f}" if f"{e}/{dtype}" in v else "—" for e in ENGINES]
            peers = {k: x for k, x in v.items() if k.endswith(f"/{dtype}") and not k.startswith("gpt2kit")}
            ratios = []
            for ours in (v.get(f"gpt2kit/{dtype}"), v.get(f"gpt2kit-a8/{dtype}")):
                ratios.append(f"{ours / max(peers.values()):.2f}x ({max(peers, key=peers.get).split('/')[0]})"
                              if ours and peers else "—")
            lines.append(f"| {label}, {dtype} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    if "bandwidth_GBs" in r:
        b1 = r["tok_s"].get("decode_b1", {})
        parts = []
        for dtype in DTYPES:
            lim = r["limit_tok_s"][dtype]
            at = ", ".join(f"{k.split('/')[0]} {x / lim:.0%}" for k, x in b1.items() if k.endswith(f"/{dtype}"))
            parts.append(f"{dtype} {r['bytes_per_token'][dtype] / 1e6:.0f} MB -> {lim:.1f} tok/s ({at})")
        lines += ["", f"physical limit, batch-1 decode (weights read per token / {r['bandwidth_GBs']:.1f} GB/s, "
                      f"a 1 GiB float32 sum on huge pages): " + "; ".join(parts)]
    for k, why in r["skipped"].items():
        lines.append(f"skipped {k}: {why}")
    lines.append("int8 means: gpt2kit int8 weights, float activations; gpt2kit int8-act. (opt-in, ungated here: "
                 "random weights) and ctranslate2 int8 weights and int8 activations with per-row scales, onnxruntime "
                 "dynamic quantization with one scale per tensor; llama.cpp Q8_0 (blocks of 32 with a scale)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        _worker(argv[1], argv[2], argv[3], int(argv[4]))
        return 0
    if argv[:1] == ["--_export-onnx"]:
        export_onnx(Path(argv[1]), Path(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    p.add_argument("--trials", type=int, default=3, help="best of this many alternating trials (default 3)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per decode trial (default 128)")
    p.add_argument("--prefill", type=int, default=1024, help="prompt tokens of the prefill workload (default 1024)")
    p.add_argument("--size", default="gpt2", help="model preset (gpt2 default; gpt2-tiny for a check of seconds)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--work", default=None, help="keep the checkpoint and conversions in this directory")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    try:
        r = run(args.threads, args.trials, args.new_tokens, args.prefill, args.size, tuple(args.engines),
                tuple(args.workloads), tuple(args.dtypes), Path(args.work) if args.work else None)
    except ValueError as e:
        print(f"bench_peers: error: {e}", file=sys.stderr)
        return 2
    print(format_table(r))
    if args.json:
        from gpt2kit._io import atomic_write_text

        atomic_write_text(args.json, json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
