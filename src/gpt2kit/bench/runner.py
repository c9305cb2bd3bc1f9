"""A `gpt2kit bench` run: the plan (full or --quick), the contenders, each workload timed with a line of
progress per phase and per trial, the judgement of each figure, and the results `report.format_table`
prints.

Both libraries run the same random-weight model of the chosen size (gpt2kit's init; transformers gets a
copy of the weights), eagerly, with default settings and the same thread count, on the same prompts
(core.py has the workloads). gpt2kit runs in float32 and in bfloat16 (and, with --quantize int8, int8
weights); transformers in float32. Each timing is the best of a few trials, alternating the contenders;
on Linux a trial during which other processes used the CPU is not quiet and is retried while trials are
left, and a figure without enough quiet trials, or whose quiet trials disagree, carries its doubt
(timing.doubt) into the report, as does a machine other processes were using before or after.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt2kit._io import atomic_write_text
from gpt2kit.bench.core import (
    TEXT,
    bench_device,
    hf_decode,
    hf_prefill,
    logprob_drift,
    machine,
    memory_bandwidth,
    memory_worker,
    ours_decode,
    ours_prefill,
    peak_memory,
    to_transformers,
    weight_bytes_per_token,
)
from gpt2kit.bench.report import format_table
from gpt2kit.bench.timing import busy_cores, doubt, synced, time_alternating
from gpt2kit.config import PRESETS, GPT2Config
from gpt2kit.decode import use_decode_layout
from gpt2kit.decode.int8 import chosen
from gpt2kit.decode.int8act import chosen as int8act_chosen
from gpt2kit.model import GPT2
from gpt2kit.quant.modules import check_scheme, quantize_model, set_activations, weight_bytes
from gpt2kit.tokenizer import Tokenizer


@dataclass(frozen=True)
class Plan:
    """What a run measures: the workloads' sizes, how many trials, and what besides the timings."""
    T: int  # prefill tokens
    new_tokens: int  # decode: tokens generated after a 16-token prompt
    trials: int  # quiet trials wanted per figure
    max_trials: int  # trials at most per figure (besides its warm-up)
    drift_tokens: int  # tokens of the text bfloat16's log-probabilities are compared on
    bandwidth_trials: int  # 0: the bandwidth (a 1 GiB buffer on huge pages) and the physical limit not measured
    memory: bool  # the peak-memory processes


FULL = Plan(T=1024, new_tokens=128, trials=3, max_trials=6, drift_tokens=512, bandwidth_trials=5, memory=True)
# --quick: an eighth of the full run's tokens, two trials and no retry (the same cost on a busy machine as on
# an idle one: the report says when they were not quiet), no bandwidth and no fresh processes
QUICK = Plan(T=128, new_tokens=16, trials=2, max_trials=2, drift_tokens=64, bandwidth_trials=0, memory=False)
PROMPT = 16  # tokens of each decode prompt


def plan_for(quick: bool, config: GPT2Config) -> Plan:
    """The quick or full plan, its lengths cut to the model's context."""
    p = QUICK if quick else FULL
    return dataclasses.replace(p, T=min(p.T, config.n_ctx), new_tokens=min(p.new_tokens, config.n_ctx - PROMPT),
                               drift_tokens=min(p.drift_tokens, config.n_ctx))


def model_facts(config: GPT2Config, parameters: int | None) -> dict[str, object]:
    """The model a run measures, for the report: its preset's name ("custom" when none matches) and shape."""
    name = next((k for k, v in PRESETS.items() if v == config), "custom")
    return {"name": name, "n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
            "n_ctx": config.n_ctx, "n_vocab": config.n_vocab, "parameters": parameters}


def _build(config: GPT2Config, device: torch.device, quantize: str | None, int8_activations: bool,
           say: Callable[[str], None]) -> dict[str, tuple]:
    """The contenders: name -> (model, make_prefill, make_decode), every gpt2kit model a copy of one
    random float32 model and transformers' holding its weights."""
    facts = model_facts(config, None)
    say(f"building the models: {facts['name']}, {config.n_layer} layers x {config.n_embd}, random weights")
    torch.manual_seed(0)
    ours32 = GPT2(config).eval()
    hf = to_transformers(ours32).to(device)
    ours16 = copy.deepcopy(ours32).to(device, torch.bfloat16)
    ours8 = None
    if quantize is not None:
        ours8 = quantize_model(copy.deepcopy(ours32).to(device), quantize, lm_head=True)
        if int8_activations:
            set_activations(ours8, "int8")
    ours32 = ours32.to(device)
    for model in (ours32, ours16):  # what generate does first; here so that prefill has it too
        use_decode_layout(model)
    engines = {"transformers/float32": (hf, hf_prefill, hf_decode),
               "gpt2kit/float32": (ours32, ours_prefill, ours_decode),
               "gpt2kit/bfloat16": (ours16, ours_prefill, ours_decode)}
    if ours8 is not None:
        engines["gpt2kit/int8"] = (ours8, ours_prefill, ours_decode)
    return engines


def _time_workloads(engines: dict[str, tuple], plan: Plan, device: torch.device, wait: float,
                    say: Callable[[str], None], results: dict) -> None:
    """Each workload's tokens/s, quiet trials and doubts into results; the greedy check's tokens."""
    g = torch.Generator().manual_seed(1)
    V = results["model"]["n_vocab"]
    long_prompt = torch.randint(0, V, (1, plan.T), generator=g).to(device)
    prompts = {B: torch.randint(0, V, (B, PROMPT), generator=g).to(device) for B in (1, 8)}
    greedy: dict[str, list] = {"transformers/float32": [], "gpt2kit/float32": []}
    n = plan.new_tokens
    for k in ("tok_s", "quiet", "spread", "doubt"):
        results[k] = {}
    for wl, tokens in (("prefill", plan.T), ("decode_b1", n), ("decode_b8", 8 * n)):
        fns = {}
        for name, (model, make_prefill, make_decode) in engines.items():
            if wl == "prefill":
                fn = make_prefill(model, long_prompt)
            else:
                B = 1 if wl == "decode_b1" else 8
                fn = make_decode(model, prompts[B], n, greedy.get(name) if B == 1 else None)
            fns[name] = synced(fn, device)
            say(f"{wl}: {name} warm-up")
            fns[name]()  # warm-up (the first may choose kernels; at batch 1 the greedy tokens)

        def on_trial(name: str, i: int, dt: float, quiet: bool, wl: str = wl) -> None:
            say(f"{wl}: {name} trial {i}: {dt:.2f} s{'' if quiet else ' (other processes used the CPU)'}")

        timings = time_alternating(fns, plan.trials, plan.max_trials, wait, on_trial)
        results["tok_s"][wl] = {k: tokens / t.seconds for k, t in timings.items()}
        results["quiet"][wl] = {k: f"{t.quiet}/{t.trials}" for k, t in timings.items()}
        results["spread"][wl] = {k: t.spread for k, t in timings.items()}
        results["doubt"][wl] = {k: doubt(t) for k, t in timings.items()}
    results["greedy_identical"] = greedy["transformers/float32"] == greedy["gpt2kit/float32"]


def _weights_and_drift(engines: dict[str, tuple], plan: Plan, device: torch.device, int8_activations: bool,
                       results: dict) -> None:
    """bfloat16's (and int8's) log-probability drift from float32, the bandwidth and the physical limit."""
    ours32, ours16 = engines["gpt2kit/float32"][0], engines["gpt2kit/bfloat16"][0]
    ours8 = engines["gpt2kit/int8"][0] if "gpt2kit/int8" in engines else None
    ids = torch.tensor([Tokenizer.default().encode(TEXT * 8)[: plan.drift_tokens]], device=device)
    results["drift_tokens"] = ids.shape[1]
    results["dlogprob_next"], results["dlogprob_vocab"] = logprob_drift(ours32, ours16, ids)
    models = {"float32": ours32, "bfloat16": ours16, **({"int8": ours8} if ours8 is not None else {})}
    results["bytes_per_token"] = {k: weight_bytes_per_token(m) for k, m in models.items()}
    results["bandwidth_GBs"] = results["limit_tok_s"] = None
    if plan.bandwidth_trials:
        bw = memory_bandwidth(plan.bandwidth_trials, device=device)
        results["bandwidth_GBs"] = bw / 1e9
        results["limit_tok_s"] = {k: bw / b for k, b in results["bytes_per_token"].items()}
    if ours8 is not None:
        results["weight_MB"] = {"float32": weight_bytes(ours32) / 1e6, "int8": weight_bytes(ours8) / 1e6}
        results["dlogprob_int8_next"], results["dlogprob_int8_vocab"] = logprob_drift(ours32, ours8, ids)
        results["int8_kernels"] = int8act_chosen() if int8_activations else chosen()
        results["int8_activations"] = int8_activations


def run(quick: bool = False, threads: int | None = None, memory: bool = True, wait: float = 0.0,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
        device: str | torch.device = "cpu", config: GPT2Config | None = None, quantize: str | None = None,
        int8_activations: bool = False) -> dict:
    """Run the benchmark; returns the results (also what `format_table` prints). wait: seconds to
    wait, before each trial, for other processes to leave the CPU (for shared machines). device:
    cpu or cuda (on cuda each trial ends with a synchronize; memory is the peak allocated).
    config: another model than gpt2 124M (the tests run a tiny one). quantize: "int8" adds gpt2kit
    with int8 weights (gpt2kit.quant.modules, LM head included) as a third column; int8_activations: that
    column with int8 activations too (gpt2kit.decode.int8act; speed only: no quality gate on random weights).
    log: one line per phase and per trial, as it goes (stderr by default).
    quick: the QUICK plan (short workloads, fewer trials, no peak-memory processes)."""
    if quantize is not None:
        check_scheme(quantize)
    device = bench_device(device)
    config = config or GPT2Config()
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    plan = plan_for(quick, config)
    t0 = time.monotonic()

    def say(line: str) -> None:
        log(f"[{time.monotonic() - t0:5.1f} s] {line}")

    info = machine(device)
    results: dict = {"machine": info, "quick": quick, "T": plan.T, "new_tokens": plan.new_tokens,
                     "busy_cores": {"before": busy_cores()}}
    say(f"gpt2kit bench{' --quick' if quick else ''}: {info['device']}, {threads} threads; prefill T={plan.T}, "
        f"decode {plan.new_tokens} new tokens; {plan.trials} quiet trials wanted per figure, at most {plan.max_trials}")
    engines = _build(config, device, quantize, int8_activations, say)
    results["model"] = model_facts(config, engines["gpt2kit/float32"][0].num_parameters())
    _time_workloads(engines, plan, device, wait, say, results)
    say("bfloat16 against float32 on the same text" + (", memory bandwidth" if plan.bandwidth_trials else ""))
    _weights_and_drift(engines, plan, device, int8_activations, results)
    results["busy_cores"]["after"] = busy_cores()
    results["memory_skipped"] = _memory_skipped(plan, memory, config)
    if results["memory_skipped"] is None:
        results["peak_MiB"] = {}
        for name in engines:
            engine, dtype = name.split("/")
            say(f"peak memory: {name}, in a fresh process")
            results["peak_MiB"][name] = peak_memory(engine, dtype, plan.T, plan.new_tokens, threads, device,
                                                    log=lambda line, name=name: say(f"peak memory: {name}: {line}"))
    say("done")
    return results


def _memory_skipped(plan: Plan, memory: bool, config: GPT2Config) -> str | None:
    """Why the peak-memory processes do not run (None: they do); they build gpt2 124M only."""
    if not memory:
        return "--no-memory"
    if not plan.memory:
        return "--quick"
    return None if config == GPT2Config() else "--size gpt2 only"


def measure_from_args(args: argparse.Namespace) -> int:
    """The measurement (or, with --_memory-worker, one worker's part of it) for checked arguments; the table
    printed, the JSON written."""
    if getattr(args, "_memory_worker", None):
        engine, dtype, T, n, threads, device = args._memory_worker
        memory_worker(engine, dtype, int(T), int(n), int(threads), device)
        return 0
    config = GPT2Config.from_name(getattr(args, "size", "gpt2"))  # not a preset: ValueError listing them
    results = run(quick=args.quick, threads=args.threads, memory=not args.no_memory,
                  wait=args.wait, device=getattr(args, "device", "cpu"), quantize=getattr(args, "quantize", None),
                  config=config, int8_activations=getattr(args, "int8_activations", False))
    print(format_table(results))
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=2))
    return 0
