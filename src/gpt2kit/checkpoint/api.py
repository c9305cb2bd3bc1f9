"""Loading and saving checkpoints: one entry point that recognises every published GPT-2 format.

`load_model(name_or_path)` accepts
1. an HF-format directory (config.json + safetensors / sharded safetensors / pytorch_model.bin),
2. a Hugging Face hub id (downloaded or taken from the local cache through huggingface_hub),
3. OpenAI's original release directory (hparams.json + model.ckpt.*), read without TensorFlow.

Loading is strict and all-or-nothing: the checkpoint's headers are checked against the config
before any tensor is read or any model built, then every tensor is read and checked again, so a
missing, unexpected or mis-shaped tensor raises CheckpointError naming the file and the tensor,
and no half-loaded model is ever returned.
"""

from __future__ import annotations

import difflib
import errno
import os
from pathlib import Path

import torch

import gpt2kit.checkpoint.hf as hf
import gpt2kit.checkpoint.hub as hub
import gpt2kit.checkpoint.openai_tf as openai_tf
import gpt2kit.checkpoint.quantized as quantized
from gpt2kit.checkpoint.contract import TensorInfo, check
from gpt2kit.checkpoint.errors import CheckpointError
from gpt2kit.config import PRESETS, GPT2Config
from gpt2kit.decode.layout import use_decode_layout
from gpt2kit.devices import resolve_device, resolve_dtype
from gpt2kit.model import GPT2
from gpt2kit.quant import is_quantized
from gpt2kit.tokenizer import Tokenizer

# Names the hub serves without an owner (legacy ids of the released GPT-2 sizes).
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2")
# OpenAI's four released sizes under both hub names: one vocabulary, the one packaged in gpt2kit/data,
# so their tokenizer never needs the hub.
GPT2_TOKENIZER_NAMES = frozenset(n for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
                                  for n in (size, f"openai-community/{size}"))


def resolve_source(name_or_path: str | os.PathLike[str]) -> tuple[str, Path]:
    """('hf' | 'openai', local directory) for a path or hub id; downloads hub ids.

    A name is sent to the hub only when it cannot be a local path: a path that exists, a broken
    symlink or loop, or a name whose first directory exists here is reported as a local problem,
    and a bare name that is neither a published GPT-2 name nor in the local cache is refused with the
    list of names."""
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
        raise CheckpointError(
            f"{raw}: not a GPT-2 checkpoint directory (no config.json for the HF layout, "
            "no hparams.json for OpenAI's release)")
    _refuse_non_hub(raw, path)
    return "hf", hub.download(raw)


def _is_dir(st: os.stat_result) -> bool:
    import stat

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


def _reader(kind: str):
    return (hf, "config.json") if kind == "hf" else (openai_tf, "hparams.json")


def read_checked_header(name_or_path: str | os.PathLike[str]
                        ) -> tuple[str, Path, GPT2Config, dict[str, TensorInfo]]:
    """(kind, directory, config, {our name: TensorInfo}), checked strictly; no tensor data is read."""
    kind, path = resolve_source(name_or_path)
    reader, config_file = _reader(kind)
    config, infos = reader.read_header(path)
    check(config, infos, path, config_file)
    return kind, path, config, infos


def load_state(name_or_path: str | os.PathLike[str]) -> tuple[GPT2Config, dict[str, torch.Tensor], Path]:
    """The config and our full, checked state dict of any loadable float checkpoint (CPU tensors)."""
    kind, path = resolve_source(name_or_path)
    if kind == "hf" and quantized.read_scheme(path) is not None:
        # Float state dicts (training, conversion) cannot come from int8 codes: say so, in one line.
        raise CheckpointError(f"{path}: holds an int8-quantized model (gpt2kit quantize), which is for inference "
                              "only; training and conversion need the float checkpoint it was made from")
    kind, path, config, infos = read_checked_header(path)
    reader, config_file = _reader(kind)
    state = reader.read_tensors(path)
    loaded = {k: TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), infos[k].file if k in infos
                            else "?") for k, t in state.items()}
    check(config, loaded, path, config_file)  # the data must say what its header said
    return config, state, path


def load_model(name_or_path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None) -> GPT2:
    """A GPT2 in eval mode from any published checkpoint (float32 unless dtype is given; "auto": the
    fastest within bfloat16's accuracy on this device, see devices.resolve_dtype)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device) or torch.float32
    kind, path = resolve_source(name_or_path)
    if kind == "hf" and quantized.read_scheme(path) is not None:
        return quantized.load(path, dtype, device)  # int8 weights (gpt2kit quantize)
    config, state, _ = load_state(path)
    with torch.device("meta"):
        model = GPT2(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return use_decode_layout(model.eval())  # the layout CPU decode kernels read fastest (decode/layout.py)


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The checkpoint's own vocab files when it has them, else GPT-2's packaged ones.

    A published GPT-2 name (GPT2_TOKENIZER_NAMES) that is not a local path gets the packaged files
    without asking the hub: they are the files those repos publish, so this works offline."""
    if name_or_path is None:
        return Tokenizer.default()
    raw = os.fspath(name_or_path)
    if raw in GPT2_TOKENIZER_NAMES and not os.path.lexists(Path(raw).expanduser()):
        return Tokenizer.default()
    _, path = resolve_source(name_or_path)
    return Tokenizer.from_dir(path)


def save_model(model: GPT2, directory: str | os.PathLike[str], *, tokenizer: Tokenizer | None = None) -> Path:
    """Write an HF-format directory that transformers and the HF ecosystem load unchanged.

    The directory is replaced atomically (built beside it, then swapped in): an existing model
    there is replaced whole or, on any failure, left as it was. Other files in it are kept. An
    int8-quantized model is written in gpt2kit's own int8 format (checkpoint/quantized.py)."""
    if is_quantized(model):
        return quantized.save(model, directory, tokenizer=tokenizer)
    return hf.save_hf_dir(model, directory, tokenizer=tokenizer)


def holds_model(path: str | os.PathLike[str]) -> bool:
    """Whether a directory holds a model (config, weights or an OpenAI release) a save would replace."""
    p = Path(path)
    return p.is_dir() and any(hf.is_model_file(f.name) or f.name in ("hparams.json", "checkpoint")
                              or f.name.startswith("model.ckpt") for f in p.iterdir())


def describe(name_or_path: str | os.PathLike[str]) -> dict:
    """What `gpt2kit info` prints: source kind, directory, config, parameter count, dtypes, files.

    Read from the checkpoint's headers (safetensors headers, the TF index) — no tensor data; an
    int8 checkpoint's tensors are read to count them."""
    kind, path = resolve_source(name_or_path)
    scheme = quantized.read_scheme(path) if kind == "hf" else None
    if scheme is not None:
        config, _, state = quantized.read_state(path)
        infos = {k: TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), "") for k, t in state.items()}
    else:
        kind, path, config, infos = read_checked_header(path)
    dtypes = sorted({i.dtype for i in infos.values()})
    files = sorted(f.name for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
    return {
        "source": "huggingface" if kind == "hf" else "openai-tf",
        "path": str(path),
        "config": {k: v for k, v in config.__dict__.items()},
        "parameters": sum(i.numel for i in infos.values()),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "files": {f: (path / f).stat().st_size for f in files},
        "quantization": scheme,
    }
