"""check(): a learner's GPT-2 against gpt2kit's, stage by stage.

The reference checkpoint is loaded as gpt2kit loads any (load_model), its weights are put into the
learner's model by name (checker.mapping), both run the same random ids in eval mode and float32,
and each stage is compared (checker.stages); the learner's model runs twice with different random
seeds, so a dropout left on in eval mode shows as two runs that differ. Then the cache and the
LayerNorm probe (checker.probes), and the first stage that differs is diagnosed (checker.diagnose).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

import gpt2kit.checker.learner as lr
from gpt2kit.checker.diagnose import Evidence, diagnose
from gpt2kit.checker.mapping import load_weights, read_mapping
from gpt2kit.checker.probes import CACHE_LABEL, EPS_LABEL, cache_check, cache_diagnosis, eps_probe
from gpt2kit.checker.report import CheckReport
from gpt2kit.checker.stages import Recorder, compare, find_points, max_abs, reference_stages, seeded, stage_table
from gpt2kit.checkpoint import load_model
from gpt2kit.model import GPT2

TOLERANCE = 1e-4


def _reference(model: str | os.PathLike[str] | GPT2) -> tuple[GPT2, str]:
    if isinstance(model, GPT2):
        ref, name = model, "the given model"
    else:
        ref, name = load_model(model, dtype=torch.float32, device="cpu"), os.fspath(model)
    state = ref.state_dict()
    if not all(t.dtype == torch.float32 for t in state.values()) or "wte.weight" not in state:
        raise ValueError(f"{name}: the reference must be a float32 model (an int8 checkpoint is not one; check "
                         "against the float model it was made from)")
    return ref.eval(), name


def _run(net: torch.nn.Module, ids: torch.Tensor, points: dict[str, str], label: str, seed: int
         ) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[str]]:
    """The learner's recorded stages and logits (B, T, V), or (B, 1, V) when it gives only the last."""
    B, T = ids.shape
    notes = []
    lr.reset_cache(net)
    with seeded(seed), Recorder(net, points) as rec:
        logits, _ = lr.call(net, ids, label)
        target = lr.first_named(lr.forward_params(net), lr.TARGET_PARAMS)
        if tuple(logits.shape[:2]) == (B, 1) and T > 1 and target is not None:
            rec.clear()  # nanoGPT's forward gives every position's logits only when given targets
            logits, _ = lr.call(net, ids, label, **{target: ids})
            notes.append(f"your forward gives the logits of every position only with {target}: it was called "
                         f"with {target}=ids")
    got = rec.data
    if logits.dim() != 3 or tuple(logits.shape[:2]) not in ((B, T), (B, 1)):
        raise lr.LearnerError(f"{label}: forward returned logits of shape {tuple(logits.shape)}; expected "
                              f"(B, T, V) = ({B}, {T}, V) for ids of shape ({B}, {T})")
    if logits.shape[1] == 1 and T > 1:
        notes.append("your forward returns the last position's logits only: the logits are compared there")
    return got, logits.detach().float(), notes


def _nondeterministic(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], specs) -> str | None:
    """The first stage whose value differs between two runs of the same ids."""
    for spec in specs:
        key = next((k for k in spec.keys if k in a), None)
        if key is not None and key in b and a[key].shape == b[key].shape and max_abs(a[key], b[key]) > 0:
            return spec.label
    return None


def check(learner: str | os.PathLike[str] | Callable, model: str | os.PathLike[str] | GPT2, *,
          config_class: Any = None, mapping: str | os.PathLike[str] | dict | None = None, seed: int = 0,
          tokens: int = 16, batch: int = 2, tol: float = TOLERANCE) -> CheckReport:
    """Check a learner's GPT-2 against gpt2kit's reference (model.py), stage by stage.

    learner: "path/to/file.py:NAME" (or the class/function itself), NAME an nn.Module class or a function
        building one, called with one argument: GPT2Config, or with config_class, the learner's own config
        (a class, dict or instance in their file, by name, or the object), filled by field name.
    model: any checkpoint gpt2kit loads (hub id, HF directory, OpenAI release) or a float32 GPT2.
    mapping: a JSON file or dict, learner parameter name -> GPT-2 name (or {"name", "transpose"}), for
        the names the automatic mapping does not know.
    Raises LearnerError (a ValueError) for unusable input; differences are in the report."""
    if tokens < 2 or batch < 1:
        raise ValueError(f"tokens must be >= 2 and batch >= 1, got tokens={tokens}, batch={batch}")
    ref_model, model_name = _reference(model)
    cfg = ref_model.config
    factory, module, label = lr.resolve_learner(learner)
    config = lr.learner_config(config_class, module, cfg)
    net = lr.build(factory, config, label)
    state = {k: v.detach().float() for k, v in ref_model.state_dict().items()}
    wm = load_weights(net, state, cfg, read_mapping(mapping))
    T = min(tokens, cfg.n_ctx)
    ids = torch.randint(0, cfg.n_vocab, (batch, T), generator=torch.Generator().manual_seed(seed))
    points = find_points(wm, cfg.n_layer)
    ref = reference_stages(ref_model, ids)
    got, logits, notes = _run(net, ids, points, label, seed)
    again, logits_again, _ = _run(net, ids, points, label, seed + 1)
    if logits.shape[1] == 1:
        ref["logits"] = ref["logits"][:, -1:]
    specs = stage_table(cfg.n_layer)
    stages = [compare(s, {**got, "logits": logits}, ref, tol) for s in specs]
    cache = cache_check(net, ids, logits, label, tol)
    eps, eps_why = eps_probe(net, points, state, tol)
    stages += [s for s in (cache, eps) if s is not None]
    first = next((s for s in stages if s.ok is False), None)
    report = CheckReport(label, model_name, cfg, (batch, T), tol, wm, stages, first, None, notes)
    if first is None:
        return report
    restless = _nondeterministic({**got, "logits": logits}, {**again, "logits": logits_again}, specs)
    order = [s.label for s in stages]
    if restless is not None and order.index(restless) <= order.index(first.label):
        report.diagnosis = (f"dropout is active in eval mode: two runs on the same ids differ from {restless} on; use "
                            "nn.Dropout modules (model.eval() turns them off) or F.dropout(x, p, "
                            "training=self.training), and dropout_p only when self.training in "
                            "F.scaled_dot_product_attention")
    elif first.label == CACHE_LABEL:
        report.diagnosis = cache_diagnosis(net, ref_model, ids, label, tol)
    elif first.label == EPS_LABEL:
        report.diagnosis = eps_why
    else:
        ev = Evidence(cfg, state, ids, got, ref, wm, points, {n: tuple(p.shape) for n, p in net.named_parameters()},
                      tol)
        report.diagnosis = diagnose(first, ev, logits, stages[: stages.index(first)])
    return report
