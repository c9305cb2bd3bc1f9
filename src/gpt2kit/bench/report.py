"""The benchmark's report: run()'s results as a markdown table, ratios and targets last."""

from __future__ import annotations

TARGETS = {  # gpt2kit / transformers float32, from the generation issue
    ("decode_b1", "float32"): 1.1, ("decode_b1", "bfloat16"): 1.8, ("decode_b8", "float32"): 1.6,
    ("prefill", "float32"): 1.0, ("prefill", "bfloat16"): 1.6,
    ("decode_b1", "int8"): 2.5, ("decode_b8", "int8"): 2.0,  # the int8 issue (with --quantize int8)
}


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
        label = "gpt2kit int8 (int8 activations)" if r.get("int8_activations") else "gpt2kit int8"
        lines[-2] = lines[-2].replace(" | quiet trials |", f" | {label} | ratio | quiet trials |")
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
            f"int8 ({'int8 activations, ungated: speed only' if r.get('int8_activations') else 'weight-only'}, "
            f"LM head included): physical limit {bpt['int8'] / 1e6:.0f} MB per token -> "
            f"{lim['int8']:.1f} tok/s (gpt2kit int8 at {b1[i8] / lim['int8']:.0%}); weight memory "
            f"{w['int8'] / w['float32']:.0%} of float32 ({'<=' if w['int8'] <= 0.30 * w['float32'] else '>'} 30%); "
            f"kernels {r['int8_kernels']}",
            f"int8 vs float32 on the same text (random weights): mean |Δ logprob| {r['dlogprob_int8_next']:.2e} "
            f"(next tokens), {r['dlogprob_int8_vocab']:.2e} (whole vocabulary); the quality gate on a trained "
            "model is in docs/quantization.md",
        ]
    return "\n".join(lines)
