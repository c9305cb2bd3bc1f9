"""A request's `interventions` (gpt2kit.trace.steering's specs): refused unless the server was started
with --allow-interventions, at most --max-interventions of them, each naming only the vectors
(--steer-vector NAME=FILE) and SAEs (--sae NAME=DIR) the server loaded at start-up, never a path;
checked against the model (points, widths, features) into the Edits its rows carry. Any refusal is
a 400 with param "interventions"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpt2kit.serve.errors import APIError

if TYPE_CHECKING:
    from gpt2kit.serve.options import ServeOptions
    from gpt2kit.serve.schemas import CompletionRequest
    from gpt2kit.trace.steering import Edits


@dataclass
class Library:
    """The vectors and SAEs requests may name, loaded (and checked against the model) at start-up."""

    vectors: dict = field(default_factory=dict)
    saes: dict = field(default_factory=dict)

    @classmethod
    def load(cls, opts: ServeOptions, model) -> Library:
        """ValueError naming the flag and file for a vector or SAE that cannot be read or does not fit."""
        lib = cls()
        if not (opts.steer_vectors or opts.saes):
            return lib
        from gpt2kit.trace.intervene import _load_vector
        from gpt2kit.trace.sae import load_sae
        from gpt2kit.trace.vectors import check_fits, read_meta

        cfg = model.config
        for pair in opts.steer_vectors:
            name, _, path = pair.partition("=")
            vec = _load_vector(path)
            check_fits(read_meta(path), model, f"--steer-vector {pair}")
            if vec.ndim != 1 or vec.shape[0] not in (cfg.n_embd, 4 * cfg.n_embd):
                raise ValueError(f"--steer-vector {pair}: shape {vec.shape}; a vector here is 1-D of n_embd "
                                 f"{cfg.n_embd} (or 4 x n_embd for mlp.pre/post)")
            lib.vectors[name] = vec
        for pair in opts.saes:
            name, _, path = pair.partition("=")
            lib.saes[name] = load_sae(path, cfg.n_layer, cfg.n_head)
        return lib


def edits_for(server, body: CompletionRequest) -> Edits | None:
    """The request's interventions checked against the model (None when it has none); 400 otherwise."""
    specs = body.interventions
    if not specs:
        return None
    opts = server.opts
    if not opts.allow_interventions:
        raise APIError(400, "interventions are off on this server (start it with --allow-interventions)",
                       param="interventions")
    if len(specs) > opts.max_interventions:
        raise APIError(400, f"{len(specs)} interventions; this server takes at most {opts.max_interventions} per "
                            f"request (--max-interventions)", param="interventions")
    from gpt2kit.trace.steering import Interventions, parse_spec, prepare

    items = []
    for i, spec in enumerate(specs):
        try:
            items.append(parse_spec(spec, server.library.vectors, server.library.saes))
        except ValueError as e:
            raise APIError(400, f"interventions[{i}]: {e}", param="interventions") from None
    try:
        return prepare(server.model, Interventions(tuple(items)))
    except ValueError as e:
        raise APIError(400, f"interventions: {e}", param="interventions") from None
