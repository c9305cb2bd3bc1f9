"""The chat template: which one serves, and the messages rendered by it into one prompt.

The template is the one given with --chat-template, else the model directory's own (as transformers
saves it: chat_template.jinja, or tokenizer_config.json's "chat_template", beside the vocabulary
files), else DEFAULT_TEMPLATE. GPT-2 was not trained on chat: the default is a plain transcript that
a language model can continue, and a completion under it stops where the model starts the next
user turn (TURN_STOPS).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gpt2kit.serve.errors import APIError

if TYPE_CHECKING:
    import gpt2kit.serve.schemas as S
    from gpt2kit.tokenizer import Tokenizer

log = logging.getLogger("gpt2kit.serve")

# A system message is the transcript's preamble; every other turn is "Role: content" on its own line,
# and the completion continues after "Assistant:".
DEFAULT_TEMPLATE = (r"{% for m in messages %}{% if m.role == 'system' %}{{ (m.content or '') ~ '\n\n' }}"
                    r"{% else %}{{ m.role | capitalize ~ ': ' ~ (m.content or '') ~ '\n' }}{% endif %}{% endfor %}"
                    r"{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
TURN_STOPS = ("\nUser:",)  # where DEFAULT_TEMPLATE's next turn begins


def resolve(given: str | None, tokenizer: Tokenizer) -> tuple[str, tuple[str, ...], str]:
    """(the template, the stop strings it adds, where it came from): --chat-template's, the model's,
    or the default with its turn marker as a stop."""
    if given is not None:
        return given, (), "--chat-template"
    found = model_template(tokenizer)
    if found is not None:
        return found[0], (), found[1]
    return DEFAULT_TEMPLATE, TURN_STOPS, "the default transcript template"


def model_template(tokenizer: Tokenizer) -> tuple[str, str] | None:
    """The chat template saved beside the model's vocabulary files, and its file; None when there is none.
    A tokenizer_config.json that is not JSON is logged and passed over (the default serves)."""
    vocab = getattr(tokenizer, "vocab_path", None)
    if vocab is None:
        return None
    folder = Path(vocab).parent
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace"), str(jinja)
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_bytes())
    except (ValueError, OSError) as e:
        log.warning("%s: not read for a chat template (%s)", config, type(e).__name__)
        return None
    found = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(found, list):  # transformers' named templates: the one named "default"
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return (found, str(config)) if isinstance(found, str) and found.strip() else None


def render(template: str, body: S.ChatRequest, eot_text: str) -> str:
    """The messages as one prompt (add_generation_prompt set; bos_token and eos_token are <|endoftext|>,
    as transformers passes them); a template that fails is a 400."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise APIError(400, "chat templates need Jinja2: pip install 'gpt2kit[serve]'") from None

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=[m.model_dump() for m in body.messages],
                                                add_generation_prompt=True, bos_token=eot_text, eos_token=eot_text,
                                                raise_exception=raise_exception)
    except Exception as e:  # a template error is the request's (or the operator's) problem
        raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param="messages") from None
