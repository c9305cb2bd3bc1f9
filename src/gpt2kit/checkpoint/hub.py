"""Hugging Face hub ids (gpt2, openai-community/gpt2-xl, any GPT-2 fine-tune) -> a local snapshot.

Downloads through huggingface_hub (its progress bars, its cache). HF_HOME / HF_HUB_CACHE choose the
cache and HF_HUB_OFFLINE=1 uses only what is cached; both are read at call time.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_CONFIG_AND_TOKENIZER = ["config.json", "generation_config.json", "vocab.json", "merges.txt",
                         "tokenizer_config.json", "special_tokens_map.json"]
_SAFETENSORS = ["model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]
_TORCH_BIN = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"]


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name


def hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def is_cached(repo_id: str) -> bool:
    """Whether the local cache holds a snapshot of `repo_id` (no network)."""
    return (Path(hub_cache_dir()) / ("models--" + repo_id.replace("/", "--")) / "snapshots").is_dir()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download(repo_id: str, revision: str | None = None) -> Path:
    """A local directory with the repo's config, tokenizer and weights (safetensors preferred)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    local_only = offline()

    def fetch(patterns: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=local_only,
                                      allow_patterns=_CONFIG_AND_TOKENIZER + patterns))

    try:
        path = fetch(_SAFETENSORS)
        if not any(path.glob("*.safetensors")):
            path = fetch(_TORCH_BIN)  # older repos publish only pytorch_model.bin
    except LocalEntryNotFoundError:
        if local_only:
            raise FileNotFoundError(
                f"model {repo_id!r} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 "
                "forbids downloading it; run once with network access or unset HF_HUB_OFFLINE") from None
        raise FileNotFoundError(
            f"model {repo_id!r} could not be downloaded (no connection to the hub?) and is not in the "
            f"local cache ({cache})") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local path nor a model on the Hugging Face hub you can access") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"revision {revision!r} of {repo_id!r} does not exist on the hub") from None
    except HfHubHTTPError as e:
        raise OSError(f"downloading {repo_id!r} from the hub failed: {e}") from None
    return path
