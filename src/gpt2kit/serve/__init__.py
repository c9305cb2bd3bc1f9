"""gpt2kit serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `gpt2kit[serve]` extra).

    from gpt2kit.serve import create_app, ServeOptions
    app = create_app(lambda: (model, tokenizer), ServeOptions(served_model_name="gpt2"))

The HTTP layer only: generation is gpt2kit.engine, scoring gpt2kit.score. See
docs/serving.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpt2kit.serve.options import ServeOptions

if TYPE_CHECKING:
    from gpt2kit.serve.app import create_app
    from gpt2kit.serve.runner import make_server, serve

__all__ = ["ServeOptions", "create_app", "make_server", "serve"]


def __getattr__(name: str) -> Any:
    """create_app, make_server and serve on first use: importing gpt2kit.serve.options (the CLI's
    flags) imports neither FastAPI nor torch."""
    if name == "create_app":
        from gpt2kit.serve.app import create_app

        return create_app
    if name in ("make_server", "serve"):
        import gpt2kit.serve.runner as runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
