"""Where a checkpoint name points: a local directory of a known layout, or a hub id (torch-free).

A name is sent to the hub only when it cannot be a local path; a mistyped directory, a symlink
loop or an unknown bare name is reported locally, with the list of names.
"""

from __future__ import annotations

import difflib
import errno
import os
import stat
from pathlib import Path

import gpt2kit.checkpoint.hf as hf
import gpt2kit.checkpoint.hub as hub
import gpt2kit.checkpoint.openai_tf as openai_tf
from gpt2kit.checkpoint.adapter_config import is_adapter_dir, not_a_model
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.config import PRESETS

__all__ = ["HUB_NAMES", "resolve_source"]

# Names the hub serves without an owner (legacy ids of the released GPT-2 sizes).
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2")


def resolve_source(name_or_path: str | os.PathLike[str]) -> tuple[str, Path]:
    """('hf' | 'openai', local directory) for a path or hub id; downloads hub ids.

    A name is sent to the hub only when it cannot be a local path: a path that exists, a broken
    symlink or loop, or a name whose first directory exists here is reported as a local problem
    (a LoRA adapter's directory as one, naming its base and how to load it), and a bare name that
    is neither a published GPT-2 name nor in the local cache is refused with the list of names."""
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    try:
        st = path.stat()
    except OSError as e:
        _local_problem(raw, path, e)
    else:
        if not _is_dir(st):
            raise CheckpointError(f"{raw}: expected a checkpoint directory, got a file")
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionError(f"{raw}: the directory exists but cannot be read (permission denied)")
        if hf.is_hf_dir(path):
            return "hf", path
        if openai_tf.is_openai_dir(path):
            return "openai", path
        if is_adapter_dir(path):
            raise not_a_model(raw, path)
        raise CheckpointError(
            f"{raw}: not a GPT-2 checkpoint directory (no config.json for the HF layout, "
            "no hparams.json for OpenAI's release)")
    _refuse_non_hub(raw, path)
    return "hf", hub.download(raw)


def _is_dir(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode)


def _local_problem(raw: str, path: Path, e: OSError) -> None:
    """Raise for a path that exists in some form but cannot be used; return if nothing is there."""
    if e.errno == errno.ELOOP:
        raise FileNotFoundError(f"{raw}: a symlink loop (it points back at itself)") from None
    if e.errno in (errno.EACCES, errno.EPERM):
        raise PermissionError(f"{raw}: cannot be read (permission denied on it or a directory above it)") from None
    if path.is_symlink():
        raise FileNotFoundError(f"{raw}: a symlink to {os.readlink(path)}, which does not exist") from None
    if e.errno not in (errno.ENOENT, errno.ENOTDIR):
        raise OSError(e.errno, f"{raw}: {e.strerror}") from None


def _refuse_non_hub(raw: str, path: Path) -> None:
    """FileNotFoundError for a name that is a missing local path rather than a hub id."""
    local = raw.startswith((".", "/", "~")) or os.sep in raw.replace("/", "") or not hub.looks_like_hub_id(raw)
    parts = Path(raw).parts
    if not local and len(parts) > 1 and Path(parts[0]).expanduser().is_dir():
        local = True  # "models/gpt2-smal" when ./models exists is a mistyped path, not a hub repo
    if local:
        parent = next((p for p in path.parents if p.is_dir()), None)
        where = f" ({parent} exists; {path.relative_to(parent)} does not)" if parent not in (None, Path(".")) else ""
        raise FileNotFoundError(f"{raw}: no such directory{where}")
    if "/" not in raw and raw not in HUB_NAMES and not hub.is_cached(raw):
        if raw in PRESETS:
            raise FileNotFoundError(f"{raw}: a preset for training from scratch (gpt2kit train --model {raw}); "
                                    "it has no published weights")
        close = difflib.get_close_matches(raw, HUB_NAMES, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise FileNotFoundError(
            f"{raw}: no such directory, and not a published GPT-2 name ({', '.join(HUB_NAMES)}) "
            f"or a hub id (owner/name){hint}")
