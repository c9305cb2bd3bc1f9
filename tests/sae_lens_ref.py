"""sae-lens's side of tests/test_trace_sae.py, run by it in a subprocess.

sae-lens 6 needs transformer-lens < 4 and the `test` extra has 4.x, so the test runs this script with
the pinned sae-lens 6 + transformer-lens 3 of tests/sae-lens.txt ahead on PYTHONPATH (installed with
--no-deps beside the venv; everything else is the venv's own torch, transformers and safetensors).

    python sae_lens_ref.py make DIR     DIR/cases.json -> DIR/<i>/ (cfg.json, sae_weights.safetensors)
    python sae_lens_ref.py encode DIR   DIR/<i>/x.safetensors -> DIR/<i>/sae_lens.safetensors (f, rec)
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
    sae = cls(cfg_cls(d_in=case["d_in"], d_sae=case["d_sae"], metadata=SAEMetadata(hook_name=case["hook"]),
                      **case["cfg"]))
    torch.manual_seed(case["seed"])
    with torch.no_grad():  # random weights (the thresholds positive): exactness needs no training
        for name, p in sae.named_parameters():
            p.copy_(torch.rand_like(p) * 0.2 if name == "threshold" else torch.randn_like(p) * 0.3)
    sae.eval().save_model(out)


def encode(case: dict, out: Path) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(out)  # sae-lens reading the files it wrote, as a user of a saved SAE would
    x = load_file(str(out / "x.safetensors"))["x"]
    t = x.shape[0]
    if case["hook"].endswith("hook_z"):  # hook_z SAEs take (..., n_head, head_dim)
        x = x.view(t, case["n_head"], -1)
    with torch.no_grad():
        f = sae.encode(x)
        rec = sae.decode(f).reshape(t, -1)
    save_file({"f": f.contiguous(), "rec": rec.contiguous()}, str(out / "sae_lens.safetensors"))


def main(argv: list[str]) -> None:
    phase, root = argv[0], Path(argv[1])
    cases = json.loads((root / "cases.json").read_text())
    for i, case in enumerate(cases):
        (make if phase == "make" else encode)(case, root / str(i))


if __name__ == "__main__":
    main(sys.argv[1:])
