"""The server's engine: the one scheduler (gpt2kit.engine.scheduler) built from the server's options,
its slots reserved and its kernels chosen before the server answers ready. Imports neither FastAPI
nor torch until it is called (benchmarks and engine tests build a server's engine without the
serve extra).
"""

from __future__ import annotations


def serve_engine(model, tokenizer, *, max_batch: int | None, pack_weights: bool | None,
                 draft_model: str | None = None, draft_tokens: int = 4, prompt_lookup: int = 0,
                 prefill_chunk: int | None = None, prefill_idle_budget: int | None = None,
                 prefix_cache=None):
    """The server's one Engine (gpt2kit.engine.scheduler): its prefill_chunk (default the engine's) and
    prefill_idle_budget; prefix_cache: where its rows' prompts start from (gpt2kit.prefix_cache); with
    draft_model (a checkpoint name, loaded like the model, refused unless it shares the model's
    tokenizer: draft_tokens a step) or prompt_lookup, its greedy rows speculate
    (gpt2kit.engine.speculate: those whose prompt + max_new_tokens + drafts fit in the context; the
    rest, sampled ones with their seeded tokens, decode as without)."""
    from gpt2kit.engine.scheduler import DEFAULT_PREFILL_CHUNK, Engine
    from gpt2kit.engine.speculate import Proposer, check_draft_model

    proposer = None
    if draft_model is not None:
        from gpt2kit.checkpoint import load_model, load_tokenizer

        if tokenizer is not None and not load_tokenizer(draft_model).same_vocabulary(tokenizer):
            raise ValueError(f"the draft model {draft_model} has another tokenizer than the model: a draft model "
                             f"must share the target's vocabulary")
        w = model.wpe.weight
        draft = load_model(draft_model, dtype=w.dtype, device=w.device)
        check_draft_model(model, draft, draft_model)  # the server refuses to start, naming the draft
        proposer = Proposer(draft, draft_tokens, sampled=False)
    elif prompt_lookup:
        proposer = Proposer(None, prompt_lookup, sampled=False)
    engine = Engine(model, tokenizer, max_batch=max_batch, pack_weights=pack_weights,
                    prefill_chunk=prefill_chunk or DEFAULT_PREFILL_CHUNK, prefill_idle_budget=prefill_idle_budget,
                    prefix_cache=prefix_cache, proposer=proposer)
    if max_batch is not None:
        engine.reserve()  # its slots now: a cache that cannot be had fails the start-up, not a request
    engine.kernels.warm_up()  # its kernel choices and packed copy before the server answers ready, not in a request
    return engine
