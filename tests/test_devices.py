"""The one dtype table and device check (gpt2kit.devices)."""

from __future__ import annotations

import pytest
import torch

from gpt2kit.devices import resolve_device, resolve_dtype


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("torch.float16", torch.float16),
                                        ("FP32", torch.float32), (torch.bfloat16, torch.bfloat16), (None, None)])
def test_dtype_names(name, dtype):
    assert resolve_dtype(name) is dtype


@pytest.mark.parametrize("bad,needle", [("int3", "unknown dtype 'int3'"), (torch.int64, "floating-point")])
def test_bad_dtypes(bad, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_dtype(bad)


def test_devices_that_are_not_there(monkeypatch):
    assert resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda:0' asked for, but .*; use --device cpu"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device 'cuda:2' does not exist; this machine has 2 CUDA device\(s\): "
                                         r"cuda:0..cuda:1"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_auto_dtype_is_the_measured_faster_one_on_cpu(tmp_path):
    import torch

    from gpt2kit.decode.plain import bfloat16_decodes_faster, half_kernel_choice
    from gpt2kit.devices import resolve_dtype

    want = torch.bfloat16 if bfloat16_decodes_faster() else torch.float32
    assert resolve_dtype("auto") == resolve_dtype("AUTO", "cpu") == want
    assert set(half_kernel_choice().values()) <= {"linear", "mv"}
