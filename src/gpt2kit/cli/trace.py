"""gpt2kit trace: one forward pass recorded exactly, written as an offline HTML report."""

from __future__ import annotations

import argparse
import json

from gpt2kit.cli.common import CLIError, read_text
from gpt2kit.cli.load import add_model_args, add_quantize_arg, check_load_args, load_for


def cmd_trace(args: argparse.Namespace) -> int:
    from gpt2kit.trace import parse_what, trace

    if args.text is not None and args.file is not None:
        raise CLIError("give a TEXT or --file, not both")
    if not (args.out or args.json or args.npz):
        raise CLIError("nothing to write: give --out report.html, --json FILE and/or --npz FILE")
    if args.top_k < 1:
        raise CLIError(f"--top-k must be >= 1, got {args.top_k}")
    if args.text is None and args.file is None and args.pairs is not None:
        text = None  # the first pair's clean text is traced
    else:
        text = args.text if args.text is not None else read_text(args.file)
        if not text:
            raise CLIError("the text is empty: nothing to trace")
    parse_what(args.what)  # a bad --what fails before the model loads
    from gpt2kit.trace.metrics import parse_metric
    from gpt2kit.trace.patching import MODES

    metric = parse_metric(args.metric)
    if args.patch not in MODES:
        raise CLIError(f"unknown --patch {args.patch!r}; choose from {', '.join(MODES)}")
    if args.compare is not None and args.compare_file is not None:
        raise CLIError("give --compare TEXT or --compare-file FILE, not both")
    compare = read_text(args.compare_file) if args.compare_file is not None else args.compare
    if compare is not None and args.pairs is not None:
        raise CLIError("give --compare/--compare-file or --pairs FILE, not both")
    check_load_args(args)  # before the model loads
    from gpt2kit.trace.intervene import parse_ablate, parse_replace, parse_steer

    interventions = ([parse_ablate(s) for s in args.ablate] + [parse_steer(s) for s in args.steer]
                     + [parse_replace(s) for s in args.replace])  # a bad form or file fails before loading
    model, tok = load_for(args)
    args.status.show(f"tracing {len(text):,} characters" if text is not None else f"tracing the pairs in {args.pairs}")
    tr = trace(model, tok, text, top_k=args.top_k, layers=args.layers, what=args.what,
               prepend_eot=args.prepend_eot, patch_from=compare, name=str(args.model),
               interventions=interventions, mean_over=args.mean_over, patch_mode=args.patch, metric=metric,
               pairs=args.pairs, attribution=args.attribution, sae=args.sae)
    wrote = []
    args.status.show("writing " + ", ".join(p for p in (args.out, args.json, args.npz) if p))
    if args.out:
        tr.save_html(args.out)
        wrote.append(args.out)
    if args.json:
        from gpt2kit._io import atomic_write

        payload = json.dumps(tr.to_json()).encode("utf-8")
        atomic_write(args.json, lambda f: f.write(payload))
        wrote.append(args.json)
    if args.npz:
        tr.save_npz(args.npz)
        wrote.append(args.npz)
    args.status.hide()
    print(f"traced {len(tr.ids)} tokens, {len(tr.tensors)} tensors; wrote {', '.join(wrote)}")
    return 0


def register_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record one forward pass exactly and write an offline HTML report")
    p.add_argument("text", nargs="?", default=None, help="the text to trace (or --file)")
    p.add_argument("--file", "-f", default=None, help="read the text from a file ('-' for stdin)")
    add_model_args(p)
    p.add_argument("--out", "-o", default=None, metavar="HTML", help="write the self-contained HTML report")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report's data at full precision")
    p.add_argument("--npz", default=None, metavar="FILE", help="write every recorded tensor (float32)")
    p.add_argument("--top-k", type=int, default=10, help="next-token predictions shown per position (default 10)")
    p.add_argument("--compare", default=None, metavar="TEXT",
                   help="a corrupted text of the same token length: residual-stream activation patching")
    p.add_argument("--compare-file", default=None, metavar="FILE",
                   help="read the --compare text from a file, as --file reads the text (final newline kept)")
    p.add_argument("--pairs", default=None, metavar="FILE.jsonl",
                   help='patching averaged over (clean, corrupt) pairs: lines {"clean","corrupt","answer","wrong"}')
    p.add_argument("--patch", default="resid", metavar="MODE",
                   help="what --compare/--pairs patch: resid (default), attn, mlp, heads, heads-pos")
    p.add_argument("--metric", default=None, metavar="SPEC",
                   help="the patching metric: logit-diff:A,B | logit:T | prob:T | loss[:T] (A, B, T one token "
                        "each, taken verbatim: ' Paris'); default the clean - corrupted top-1 logit difference")
    p.add_argument("--attribution", action="store_true",
                   help="also estimate every patching cell by attribution patching (gradient x difference)")
    p.add_argument("--layers", default=None, help="blocks to record: all (default), N, N-M, comma list; -1 = last")
    p.add_argument("--what", default=None,
                   help="tensors to record: all (default) or a comma list of attn, mlp, embed, resid, ln, qkv, "
                        "scores, probs, z, attn_out, mlp_pre, mlp_post, mlp_out")
    p.add_argument("--prepend-eot", action="store_true", help="put <|endoftext|> before the text (and --compare)")
    p.add_argument("--sae", default=None, metavar="DIR",
                   help="a sparse autoencoder saved in SAELens's format (cfg.json + sae_weights.safetensors): "
                        "its features at its hook point")
    p.add_argument("--ablate", action="append", default=[], metavar="NAME[@POS][:mean]",
                   help="zero (or mean-) ablate at a trace or TransformerLens name, e.g. h.5.attn.head.3, "
                        "h.7.mlp:mean, resid.2@4 (repeatable; docs/trace.md)")
    p.add_argument("--steer", action="append", default=[], metavar="NAME[@POS]:VEC.npy[*SCALE]",
                   help="add SCALE x the vector at a name, e.g. h.6.resid:happy.npy*4 (repeatable)")
    p.add_argument("--replace", action="append", default=[], metavar="NAME[@POS]:VALUE.npy",
                   help="set the tensor at a name to the array (repeatable)")
    p.add_argument("--mean-over", default=None, metavar="TEXT",
                   help="the text a :mean ablation averages over (default: the traced text)")
    add_quantize_arg(p)
    p.set_defaults(func=cmd_trace)


def add_intervention_args(p: argparse.ArgumentParser, *, generating: bool) -> None:
    """The trace's intervention flags for generate and score (the same names and forms as trace's)."""
    p.add_argument("--ablate", action="append", default=[], metavar="NAME[:zero]",
                   help="zero the tensor at a trace or TransformerLens name at every step, e.g. h.9.attn.head.9 "
                        "(repeatable; docs/trace.md)")
    p.add_argument("--steer", action="append", default=[], metavar="NAME:VEC.npy[*SCALE]",
                   help="add SCALE x the vector at a name at every step, e.g. h.6.resid:love.npy*4 (repeatable; "
                        "gpt2kit steer make writes one)")
    p.add_argument("--replace", action="append", default=[], metavar="NAME:VALUE.npy",
                   help="set the tensor at a name to the array at every step (repeatable)")
    p.add_argument("--sae", default=None, metavar="DIR",
                   help="a sparse autoencoder in SAELens's format whose features --clamp sets")
    p.add_argument("--clamp", action="append", default=[], metavar="FEATURE=VALUE",
                   help="set the --sae feature to VALUE at its hook point (the SAE's error term kept; repeatable)")
    if generating:
        p.add_argument("--intervene-on", default="both", choices=("both", "prompt", "generated"),
                       help="the positions interventions change: the prompt's, the generated tokens' or both")


def parse_interventions(args: argparse.Namespace) -> list:
    """The flags' ablations, steering vectors and replacements (a bad form or file fails here, before
    the model loads); --clamp's FEATURE=VALUE pairs are checked too."""
    from gpt2kit.trace.intervene import parse_ablate, parse_replace, parse_steer
    from gpt2kit.trace.steering import parse_clamps

    if args.clamp and args.sae is None:
        raise CLIError("--clamp sets features of an SAE: give --sae DIR")
    if args.sae is not None and not args.clamp:
        raise CLIError("--sae DIR here is for --clamp FEATURE=VALUE (its features in a report: gpt2kit trace --sae)")
    args.clamps = parse_clamps(args.clamp) if args.clamp else ()
    return ([parse_ablate(s) for s in args.ablate] + [parse_steer(s) for s in args.steer]
            + [parse_replace(s) for s in args.replace])


def interventions_for(args: argparse.Namespace, model, items: list):
    """The checked interventions (gpt2kit.trace.steering.prepare) for the loaded model, or None."""
    from gpt2kit.trace.steering import Clamp, Interventions, prepare

    if args.sae is not None:
        items = [*items, Clamp(args.sae, args.clamps)]
    if not items:
        return None
    return prepare(model, Interventions(tuple(items), getattr(args, "intervene_on", "both")))


def cmd_steer_make(args: argparse.Namespace) -> int:
    from gpt2kit.trace.vectors import POSITIONS, make_vector, save_vector

    if args.position not in POSITIONS:
        raise CLIError(f"--position {args.position!r}: choose from {', '.join(POSITIONS)}")
    files = (args.positive_file, args.negative_file)
    if any(f is not None for f in files):
        if not all(f is not None for f in files) or args.positive is not None or args.negative is not None:
            raise CLIError("give POSITIVE and NEGATIVE texts, or --positive-file and --negative-file (one prompt a "
                           "line), not a mix")
        positive, negative = (_prompt_lines(f) for f in files)
    elif args.positive is None or args.negative is None:
        raise CLIError("give a POSITIVE and a NEGATIVE text (or --positive-file and --negative-file)")
    else:
        positive, negative = [args.positive], [args.negative]
    point = args.point if args.point is not None else f"resid.{args.layer}" if args.layer is not None else None
    if point is None or (args.point is not None and args.layer is not None):
        raise CLIError("give the point: --layer L (the residual stream before block L) or --point NAME, one of them")
    check_load_args(args)
    model, tok = load_for(args)
    args.status.show(f"reading {point} over {len(positive) + len(negative)} prompts")
    vec, meta = make_vector(model, tok, positive, negative, point, position=args.position)
    save_vector(args.out, vec, meta, str(args.model))
    args.status.hide()
    print(f"wrote {args.out} ({meta['method']} at {meta['point']}, width {meta['width']}, "
          f"norm {float((vec.astype('float64') ** 2).sum() ** 0.5):.4g}) and {args.out}.json")
    return 0


def _prompt_lines(path: str) -> list[str]:
    lines = [line for line in read_text(path).splitlines() if line.strip()]
    if not lines:
        raise CLIError(f"{path}: no prompts (one a line)")
    return lines


def register_steer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("steer", help="make steering vectors (for --steer in generate, score, trace and serve)")
    verbs = p.add_subparsers(dest="steer_command", metavar="VERB")
    verbs.required = True
    m = verbs.add_parser("make", help="the difference of two prompts' activations (ActAdd), or of two files' means")
    m.add_argument("positive", nargs="?", default=None, help="the text to steer towards")
    m.add_argument("negative", nargs="?", default=None, help="the text to steer away from")
    add_model_args(m)
    m.add_argument("--layer", type=int, default=None, help="read the residual stream before block L (resid.L)")
    m.add_argument("--point", default=None, metavar="NAME", help="read at a trace or TransformerLens name instead")
    m.add_argument("--position", default="last", help="last (the last token's, ActAdd's default) or mean")
    m.add_argument("--positive-file", default=None, metavar="FILE", help="prompts to steer towards, one a line")
    m.add_argument("--negative-file", default=None, metavar="FILE", help="prompts to steer away from, one a line")
    m.add_argument("--out", "-o", required=True, metavar="VEC.npy",
                   help="the vector (1-D float32 .npy); VEC.npy.json beside it names the model, point and width")
    add_quantize_arg(m)
    m.set_defaults(func=cmd_steer_make)
