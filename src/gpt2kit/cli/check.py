"""gpt2kit check: a learner's own GPT-2 against gpt2kit's, stage by stage (docs/check.md).

Exit codes: 0 every stage matches, 1 a stage differs (the report says which and why), 2 the input
could not be used (the file, NAME, the config, the mapping, the checkpoint, a forward that raises)."""

from __future__ import annotations

import argparse

from gpt2kit.cli.common import InputError, one_line


def cmd_check(args: argparse.Namespace) -> int:
    args.status.show(f"checking {args.learner} against {args.model}")
    try:
        from gpt2kit.checker import check

        report = check(args.learner, args.model, config_class=args.config_class, mapping=args.map,
                       seed=args.seed, tokens=args.tokens)
    except Exception as e:  # anything that stops the check is its input's fault: 1 means "differs" here
        raise InputError(one_line(e)) from e
    args.status.hide()
    print(report.format())
    return report.exit_code


def register_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check your own GPT-2 implementation against gpt2kit's, stage by stage",
        description="Load the reference weights into your model by name, run both on the same tokens and "
                    "compare every stage (embeddings, each block's ln_1, attention, residual, ln_2, MLP, "
                    "residual, the final norm, the logits; a cache if your forward takes one), naming the first "
                    "that differs and the likely mistake. Exit 0: all match within 1e-4; 1: a stage differs; "
                    "2: bad input. See docs/check.md.")
    p.add_argument("learner", metavar="PATH.py:NAME",
                   help="your file and the nn.Module class (or function building one) in it, called with the "
                        "config; its forward takes token ids (B, T) and returns logits (B, T, V) or a tuple "
                        "starting with them")
    p.add_argument("--model", "-m", required=True,
                   help="the reference checkpoint: hub id (gpt2, gpt2-medium, ...), HF directory, or OpenAI TF "
                        "release directory")
    p.add_argument("--config-class", default=None, metavar="NAME",
                   help="call your model with your own config: NAME is a config class, dict or instance in your "
                        "file, filled by field name (vocab_size, block_size, n_embd, n_head, n_layer, d_model, "
                        "emb_dim, n_heads, n_layers, context_length, drop_rate, qkv_bias, ...); default: gpt2kit's "
                        "GPT2Config (n_vocab, n_ctx, n_embd, n_head, n_layer)")
    p.add_argument("--map", default=None, metavar="FILE.json",
                   help="names the automatic mapping does not know: a JSON object of your parameter name -> "
                        "GPT-2's (h.0.attn.c_attn.weight, ...), or -> {\"name\": ..., \"transpose\": true}")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per sequence, two sequences (default 16)")
    p.set_defaults(func=cmd_check)
