"""The benchmark's report: run()'s results as a markdown table, ratios last in each pair, and whether the
figures can be trusted (a ratio from a doubtful figure is marked, never printed as a finding)."""

from __future__ import annotations

from gpt2kit.bench.timing import MAX_SPREAD, MIN_QUIET, machine_doubt

REF = "transformers/float32"
OURS = {"gpt2kit/float32": "gpt2kit fp32", "gpt2kit/bfloat16": "gpt2kit bf16", "gpt2kit/int8": "gpt2kit int8"}
UNRELIABLE = " (unreliable)"


def describe_model(m: dict) -> str:
    """"gpt2-tiny (4 layers x 128, 4 heads, context 256, 7.0M parameters)": the model a run measured."""
    return (f"{m['name']} ({m['n_layer']} layers x {m['n_embd']}, {m['n_head']} heads, context {m['n_ctx']}, "
            f"{m['parameters'] / 1e6:.1f}M parameters)")


def _busy(r: dict) -> str | None:
    return machine_doubt(r["busy_cores"].get("before"), r["busy_cores"].get("after"), r["machine"]["cores"])


def doubts(r: dict) -> list[str]:
    """Why figures of this run are not to be quoted: the machine's load, then each doubtful figure."""
    busy = _busy(r)
    return ([busy] if busy else []) + [f"{wl} {name}: {why}" for wl, d in r["doubt"].items()
                                       for name, why in d.items() if why]


def _ratio(r: dict, wl: str, name: str) -> str:
    """gpt2kit's figure over transformers', marked when either figure or the machine is in doubt."""
    v, d = r["tok_s"][wl], r["doubt"][wl]
    return f"{v[name] / v[REF]:.2f}x" + (UNRELIABLE if d.get(name) or d.get(REF) or _busy(r) else "")


def _header(r: dict) -> list[str]:
    m = r["machine"]
    on_gpu = m.get("device_type") == "cuda"
    return [
        (f"device: {m['device']} (cuda); " if on_gpu else "")
        + f"machine: {m['cpu']}, {m['cores']} cores ({' '.join(m['isa'])}); {m['threads']} threads; "
        f"torch {m['torch']}, transformers {m['transformers']}, python {m['python']}",
        f"model: {describe_model(r['model'])}, random weights (the same in both); eager; greedy; best of the "
        "quiet trials; gpt2kit with its defaults (prepacked weights where they help: float32 batches, bfloat16)"
        + ("; --quick: short workloads, few trials" if r.get("quick") else ""),
        *([m["kernel_note"]] if m.get("kernel_note") else []),
        "",
    ]


def _table(r: dict, ours: list[str]) -> list[str]:
    int8 = "gpt2kit int8 (int8 activations)" if r.get("int8_activations") else "gpt2kit int8"
    heads = " | ".join(f"{int8 if c == 'gpt2kit/int8' else OURS[c]} | ratio" for c in ours)
    lines = [f"| workload | transformers fp32 | {heads} | quiet trials |",
             "|---|--:|" + "--:|--:|" * len(ours) + "---|"]
    names = {"prefill": f"prefill tok/s (T={r['T']})", "decode_b1": f"decode tok/s, batch 1 ({r['new_tokens']} new)",
             "decode_b8": f"decode tok/s, batch 8 ({r['new_tokens']} new)"}
    for wl, label in names.items():
        v, q = r["tok_s"][wl], r["quiet"][wl]
        cells = " | ".join(f"{v[c]:.1f} | {_ratio(r, wl, c)}" for c in ours)
        lines.append(f"| {label} | {v[REF]:.1f} | {cells} | {', '.join(q[c] for c in [REF, *ours])} |")
    if r.get("peak_MiB"):
        p = r["peak_MiB"]
        what = "peak GPU memory allocated" if r["machine"].get("device_type") == "cuda" else "peak RSS above baseline"
        cells = " | ".join(f"{p[c]:.0f} | {p[c] / p[REF]:.2f}x" for c in ours)
        lines.append(f"| {what}, MiB (lower is better) | {p[REF]:.0f} | {cells} | |")
    if "gpt2kit/int8" in ours:
        w = r["weight_MB"]
        lines.append(f"| weight memory, MB (lower is better) | {w['float32']:.0f} | {w['float32']:.0f} | 1.00x | "
                     f"{w['float32'] / 2:.0f} | 0.50x | {w['int8']:.0f} | {w['int8'] / w['float32']:.2f}x | |")
    return lines


def _share(r: dict, name: str, limit: float) -> str:
    """A batch-1 decode figure as a share of the physical limit, marked when the figure is doubtful."""
    unsure = r["doubt"]["decode_b1"].get(name) or _busy(r)
    return f"{r['tok_s']['decode_b1'][name] / limit:.0%}" + (UNRELIABLE if unsure else "")


def _limits(r: dict, ours: list[str]) -> str:
    """The physical limit of batch-1 decode and each figure's share of it (when the bandwidth was measured)."""
    lim, bpt = r["limit_tok_s"], r["bytes_per_token"]
    if not lim:
        return "physical limit, batch-1 decode: not measured (--quick: it reads a 1 GiB buffer)"
    where = "GPU" if r["machine"].get("device_type") == "cuda" else "CPU"
    line = (f"physical limit, batch-1 decode: weights read per token / bandwidth ({r['bandwidth_GBs']:.1f} GB/s, "
            f"1 GiB float32 sum, {where}): float32 {bpt['float32'] / 1e6:.0f} MB -> {lim['float32']:.1f} tok/s "
            f"(gpt2kit at {_share(r, 'gpt2kit/float32', lim['float32'])}, transformers at "
            f"{_share(r, REF, lim['float32'])}); bfloat16 {bpt['bfloat16'] / 1e6:.0f} MB -> {lim['bfloat16']:.1f} "
            f"tok/s (gpt2kit at {_share(r, 'gpt2kit/bfloat16', lim['bfloat16'])})")
    if "gpt2kit/int8" in ours:
        line += (f"; int8 {bpt['int8'] / 1e6:.0f} MB -> {lim['int8']:.1f} tok/s "
                 f"(gpt2kit int8 at {_share(r, 'gpt2kit/int8', lim['int8'])})")
    return line


def _notes(r: dict, ours: list[str]) -> list[str]:
    lines = [
        "",
        _limits(r, ours),
        f"bfloat16 vs float32 on the same text ({r['drift_tokens']} tokens): mean |Δ logprob| "
        f"{r['dlogprob_next']:.2e} (next tokens), {r['dlogprob_vocab']:.2e} (whole vocabulary)",
        f"greedy batch-1 tokens identical to transformers: {'yes' if r['greedy_identical'] else 'NO'}",
    ]
    if r.get("memory_skipped"):
        lines.append(f"peak memory: not measured ({r['memory_skipped']})")
    if "gpt2kit/int8" in ours:
        w = r["weight_MB"]
        lines += [
            f"int8 ({'int8 activations, ungated: speed only' if r.get('int8_activations') else 'weight-only'}, "
            f"LM head included): {r['bytes_per_token']['int8'] / 1e6:.0f} MB read per token; weight memory "
            f"{w['int8'] / w['float32']:.0%} of float32; kernels {r['int8_kernels']}",
            f"int8 vs float32 on the same text (random weights): mean |Δ logprob| {r['dlogprob_int8_next']:.2e} "
            f"(next tokens), {r['dlogprob_int8_vocab']:.2e} (whole vocabulary); the quality gate on a trained "
            "model is in docs/quantization.md",
        ]
    return lines


def reliability(r: dict) -> list[str]:
    """The verdict on the run's figures: why they are unreliable and what to do, or that they held."""
    found = doubts(r)
    if found:
        return ["", "UNRELIABLE: other work on this machine disturbed the timings; ratios marked"
                f"{UNRELIABLE} are not findings:", *(f"- {why}" for why in found),
                "To measure: close other programs, then rerun" + (" without --quick" if r.get("quick") else "")
                + " (--wait 20 waits up to 20 s before each trial for the CPU to go idle)."]
    unread = r["busy_cores"].get("before") is None
    lines = ["", f"every figure had at least {MIN_QUIET} quiet trials within {MAX_SPREAD:.0%} of each other"
             + ("; other processes' CPU use cannot be read here (no /proc/stat), so every trial counts as quiet"
                if unread else "; the machine was idle before and after the timings")]
    if r.get("quick"):
        lines.append("--quick measures short workloads with few trials: rerun without --quick for figures to quote")
    return lines


def format_table(r: dict) -> str:
    ours = [c for c in OURS if c in r["tok_s"]["prefill"]]
    return "\n".join([*_header(r), *_table(r, ours), *_notes(r, ours), *reliability(r)])
