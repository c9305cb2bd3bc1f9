"""sae-lens's side of tests/test_trace_sae.py, run by it in a subprocess.

sae-lens 6 needs transformer-lens < 4 and the `test` extra has 4.x, so the test runs this script with
the pinned sae-lens 6 + transformer-lens 3 of tests/sae-lens.txt ahead on PYTHONPATH (installed with
--no-deps beside the venv; everything else is the venv's own torch, transformers and safetensors).

    python sae_lens_ref.py make DIR     DIR/cases.json -> DIR/<i>/ (cfg.json, sae_weights.safetensors)
    python sae_lens_ref.py encode DIR   DIR/<i>/x.safetensors -> DIR/<i>/sae_lens.safetensors (f, rec)
    python sae_lens_ref.py generate DIR DIR/hf and DIR/<i>/ -> DIR/<i>/generated.safetensors (greedy under a clamp)

A case with "tl" reads its own activations instead of x.safetensors: the model in DIR/hf (transformers'
format) loaded into TransformerLens as sae-lens tells a user of such an SAE to load it
(HookedTransformer.from_pretrained_no_processing(..., **metadata.model_from_pretrained_kwargs)), run on
the case's ids, and the SAE's hook read from its cache; the activations it read are saved too (x).

`generate` is a feature clamp as a sae-lens user writes it: the model in DIR/hf loaded the same way into
sae-lens's HookedSAETransformer, the SAE attached with add_sae(sae, use_error_term=True), a hook on its
hook_sae_acts_post setting the case's "clamp" features at every position, and the case's "n" tokens
chosen greedily after its "prompt" by TransformerLens's generate(do_sample=False): without its KV cache
(each step re-runs the whole sequence: `tokens`, and each step's last-position `logits`) and with it
(`cached_tokens`, `cached_logits`). DIR/hf holds GPT-2's tokenizer files too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make(case: dict, out: Path) -> None:
    from sae_lens.saes.jumprelu_sae import JumpReLUSAE, JumpReLUSAEConfig
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig
    from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig

    cls, cfg_cls = {"standard": (StandardSAE, StandardSAEConfig), "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
                    "topk": (TopKSAE, TopKSAEConfig)}[case["arch"]]
    meta = SAEMetadata(hook_name=case["hook"], **case.get("meta", {}))
    sae = cls(cfg_cls(d_in=case["d_in"], d_sae=case["d_sae"], metadata=meta, **case["cfg"]))
    torch.manual_seed(case["seed"])
    with torch.no_grad():  # random weights (the thresholds positive): exactness needs no training
        for name, p in sae.named_parameters():
            p.copy_(torch.rand_like(p) * 0.2 if name == "threshold" else torch.randn_like(p) * 0.3)
    sae.eval().save_model(out)


def tl_model(hf_dir: Path, kwargs: dict, cls=None):
    """The transformers model in hf_dir loaded into TransformerLens (cls: HookedTransformer or a subclass)
    the way from_pretrained_no_processing(**kwargs) loads a named model (no processing, then kwargs' own)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, d_head=c.n_embd // c.n_head,
                                  n_heads=c.n_head, d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, n_ctx=c.n_positions,
                                  act_fn="gelu_new", normalization_type="LN", eps=c.layer_norm_epsilon)
    model = (cls or HookedTransformer)(cfg)
    flags = {"fold_ln": False, "center_writing_weights": False, "center_unembed": False, "fold_value_biases": False}
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), **{**flags, **kwargs})
    return model.eval()


def tl_activations(hf_dir: Path, ids: list[int], hook: str, kwargs: dict) -> torch.Tensor:
    """The activations at hook of the transformers model in hf_dir, loaded by tl_model."""
    model = tl_model(hf_dir, kwargs)
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([ids]))
    return cache[hook][0]


def encode(case: dict, out: Path) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(out)  # sae-lens reading the files it wrote, as a user of a saved SAE would
    if case.get("tl"):
        kwargs = sae.cfg.metadata.model_from_pretrained_kwargs or {}
        x = tl_activations(out.parent / "hf", case["ids"], case["hook"], kwargs)  # (T, D) or (T, nh, hs)
    else:
        x = load_file(str(out / "x.safetensors"))["x"]
    t = x.shape[0]
    if case["hook"].endswith("hook_z"):  # hook_z SAEs take (..., n_head, head_dim)
        x = x.view(t, case["n_head"], -1)
    with torch.no_grad():
        f = sae.encode(x)
        rec = sae.decode(f).reshape(t, -1)
    save_file({"f": f.contiguous(), "rec": rec.contiguous(), "x": x.reshape(t, -1).contiguous()},
              str(out / "sae_lens.safetensors"))


def generate(case: dict, out: Path) -> None:
    from sae_lens import SAE, HookedSAETransformer
    from transformers import GPT2TokenizerFast

    sae = SAE.load_from_disk(out)
    model = tl_model(out.parent / "hf", sae.cfg.metadata.model_from_pretrained_kwargs or {}, HookedSAETransformer)
    model.add_sae(sae, use_error_term=True)
    feats = torch.tensor([int(f) for f in case["clamp"]])
    vals = torch.tensor(list(case["clamp"].values()), dtype=torch.float32)

    def clamp(acts: torch.Tensor, hook) -> torch.Tensor:  # (B, T, F) at every position
        acts = acts.clone()
        acts[..., feats] = vals.to(acts)
        return acts

    hooks = [(f"{case['hook']}.hook_sae_acts_post", clamp)]
    # TransformerLens 3.9's cached generate places a new token at the wrong position when it has no
    # tokenizer (W_pos sliced from the cache's length for the whole sequence), so the model gets one
    model.set_tokenizer(GPT2TokenizerFast.from_pretrained(out.parent / "hf"))
    prompt = torch.tensor([case["prompt"]])
    got = {}
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        for key, cache in (("", False), ("cached_", True)):
            r = model.generate(prompt, max_new_tokens=case["n"], do_sample=False, stop_at_eos=False,
                               use_past_kv_cache=cache, prepend_bos=False, verbose=False, return_type="tokens",
                               output_logits=True)
            got[key + "tokens"] = r.sequences[0, prompt.shape[1]:].contiguous()
            got[key + "logits"] = torch.cat(r.logits).contiguous()  # (n, V): each step's last position
    save_file(got, str(out / "generated.safetensors"))


PHASES = {"make": make, "encode": encode, "generate": generate}


def main(argv: list[str]) -> None:
    phase, root = argv[0], Path(argv[1])
    cases = json.loads((root / "cases.json").read_text())
    for i, case in enumerate(cases):
        PHASES[phase](case, root / str(i))


if __name__ == "__main__":
    main(sys.argv[1:])
