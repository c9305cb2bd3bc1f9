"""gpt2kit's float32 few-row kernel (decode/f32.py, csrc/f32_linear.c): the product F.linear computes,
to float32 round-off, on any shape; the decode on it gives the same greedy tokens; its override and
its absence are one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import random_model

from gpt2kit.decode import decode_step, f32, kernel_choice, kernels_for, native, prefill, use_decode_layout
from gpt2kit.kv_cache import KVCache

NATIVE = [k for k in f32.KERNELS if k != "torch"]


def _runs(kernel: str) -> None:
    why = native.why_f32_unavailable(kernel.removeprefix("native-"))
    if why is not None:
        pytest.skip(f"{kernel} cannot run here: {why}")


@pytest.mark.parametrize("kernel", NATIVE)
@pytest.mark.parametrize("k_in, n_out", [(1, 1), (5, 3), (17, 33), (31, 47), (64, 200), (100, 1001)])
def test_the_kernel_is_f_linear_to_float32_round_off(kernel, k_in, n_out):
    _runs(kernel)
    g = torch.Generator().manual_seed(k_in * 1000 + n_out)
    fn = f32.product(kernel)
    for ldw in (n_out, n_out + 3):  # the tied head's wte may be a view into a wider matrix
        wt = torch.randn(k_in, ldw, generator=g)[:, :n_out]  # (in, out): decode/layout.py's float32 layout
        w = wt.t()  # (out, in), stride (1, ldw)
        for rows in range(1, f32.MAX_ROWS + 1):
            for bias in (torch.randn(n_out, generator=g), None):
                x = torch.randn(rows, k_in, generator=g)
                ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                got = fn(x, w, bias)
                assert got.shape == (rows, n_out) and got.dtype == torch.float32
                # float32 summation in another order: within K eps sum|x w| of the exact product
                tol = 2 * k_in * 1.2e-7 * (x.abs().double() @ w.abs().double().t()) + 1e-6
                assert ((got.double() - ref).abs() <= tol).all(), (rows, bias is None, ldw)


@pytest.mark.parametrize("kernel", NATIVE)
def test_calls_the_kernel_does_not_take_run_on_f_linear(kernel):
    _runs(kernel)
    g = torch.Generator().manual_seed(0)
    w_rowmajor = torch.randn(40, 24, generator=g)  # (out, in) contiguous: not the decode layout
    x9 = torch.randn(9, 24, generator=g)  # more than MAX_ROWS rows
    for x, w in ((x9, w_rowmajor.t().contiguous().t()), (x9[:2], w_rowmajor), (x9[:, ::2], w_rowmajor[:, :12])):
        assert torch.equal(f32.product(kernel)(x, w, None), F.linear(x, w))


@pytest.mark.parametrize("kernel", NATIVE)
def test_a_decode_on_the_kernel_gives_the_same_greedy_tokens(kernel, monkeypatch):
    _runs(kernel)
    model = use_decode_layout(random_model())
    idx = torch.tensor([[5, 17, 3, 99, 42]])

    def greedy(env: str) -> tuple[list[int], list[torch.Tensor]]:
        monkeypatch.setenv(f32.ENV, env)
        ks = kernels_for(model, 1)
        assert (ks.kernel_set.for_rows(1, torch.float32, True).product is F.linear) == (env == "torch")
        cache = KVCache.for_model(model, 1, 32)
        logits = prefill(model, idx, None, cache)
        out, seen = [], []
        for _ in range(12):
            tok = logits.argmax(-1, keepdim=True)  # (1, 1)
            out.append(int(tok))
            logits = decode_step(model, tok, cache, kernels=ks)
            seen.append(logits)
        return out, seen

    torch_tokens, torch_logits = greedy("torch")
    native_tokens, native_logits = greedy(kernel)
    assert native_tokens == torch_tokens
    for a, b in zip(native_logits, torch_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _run(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    import gpt2kit

    base = {k: v for k, v in os.environ.items() if k not in (f32.ENV, "GPT2KIT_NO_NATIVE", "GPT2KIT_CPU_FLAGS")}
    env = {**base, "PYTHONPATH": str(Path(gpt2kit.__file__).parents[1]), kernel_choice.STORE_ENV: str(tmp_path),
           **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_a_bad_override_names_the_choices(monkeypatch):
    monkeypatch.setenv(f32.ENV, "fast")
    with pytest.raises(ValueError, match="GPT2KIT_F32_KERNEL='fast' is not a float32 kernel; valid choices: "
                                         "torch, native-avx512, native-avx2"):
        f32.forced()


@pytest.mark.parametrize("env, said", [
    ({f32.ENV: "fast"}, "GPT2KIT_F32_KERNEL='fast' is not a float32 kernel; valid choices: torch, native-avx512, "
                        "native-avx2"),
    ({f32.ENV: "native-avx2", "GPT2KIT_NO_NATIVE": "1"},
     "GPT2KIT_F32_KERNEL='native-avx2' is unavailable here (GPT2KIT_NO_NATIVE is set); available: torch"),
])
def test_a_bad_override_is_one_line_on_the_command_line(tmp_path, env, said):
    code = "from gpt2kit.cli import main; raise SystemExit(main(['score', '/dev/null', '-m', 'gpt2']))"
    done = _run(code, tmp_path, **env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and said in lines[0], done.stderr


def test_an_instruction_set_the_cpu_lacks_is_unavailable_and_never_chosen(tmp_path):
    code = """
import json, torch
from gpt2kit.decode import f32, native
mats = [(torch.randn(16, 40).t(), torch.randn(40)), (torch.randn(16, 90).t(), None)]
c = f32.decide_for("16x1x90", mats)
try:
    f32.check_kernel("native-avx512")
    said = None
except ValueError as e:
    said = str(e)
print(json.dumps([native.why_f32_unavailable("avx512"), said, c.kernel, sorted(c.medians_ms)]))
"""
    timings = {"torch": 1e-3, "native-avx512": 1e-4, "native-avx2": 5e-4}
    done = _run(code, tmp_path, GPT2KIT_CPU_FLAGS="fpu sse2 avx2 fma",
                GPT2KIT_KERNEL_TIMINGS=json.dumps(timings))
    assert done.returncode == 0, done.stderr
    why, said, kernel, measured = json.loads(done.stdout)
    if native.why_f32_unavailable("avx2") is not None:
        pytest.skip(f"the native kernel cannot run here: {native.why_f32_unavailable('avx2')}")
    assert why == "this CPU lacks avx512f"
    assert said == ("GPT2KIT_F32_KERNEL='native-avx512' is unavailable here (this CPU lacks avx512f); "
                    "available: torch, native-avx2")
    assert kernel == "native-avx2" and measured == ["native-avx2", "torch"]  # the fastest that can run


def test_a_measured_choice_is_stored_and_reused(tmp_path):
    code = """
import json, torch
from gpt2kit.decode import f32
mats = [(torch.randn(16, 40).t(), torch.randn(40)), (torch.randn(16, 90).t(), None)]
c = f32.decide_for("16x1x90", mats)
f32.forget()
again = f32.decide_for("16x1x90", mats)
print(json.dumps([c.kernel, c.source, again.kernel, again.source]))
"""
    if native.why_f32_unavailable("avx2") is not None:
        pytest.skip(f"the native kernel cannot run here: {native.why_f32_unavailable('avx2')}")
    timings = {"torch": [1e-3] * 7, "native-avx512": [2e-3] * 7, "native-avx2": [4e-4] * 7}
    done = _run(code, tmp_path, GPT2KIT_KERNEL_TIMINGS=json.dumps(timings))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["native-avx2", "measured", "native-avx2", "stored"]


def test_without_the_native_library_the_decode_runs_on_torch(tmp_path):
    code = """
import json
from gpt2kit.decode import f32, native
print(json.dumps([native.why_f32_unavailable("avx2"), f32.product("torch").__name__]))
"""
    done = _run(code, tmp_path, GPT2KIT_NO_NATIVE="1")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["GPT2KIT_NO_NATIVE is set", "linear"]


def test_bench_kernels_shows_the_float32_choice(tmp_path):
    code = "from gpt2kit.cli import main; raise SystemExit(main(['bench', '--kernels']))"
    done = _run(code, tmp_path, GPT2KIT_F32_KERNEL="torch", GPT2KIT_INT8_KERNEL="dequant")
    assert done.returncode == 0, done.stderr
    assert "| float32 products, GPT-2 124M (768x12x50257) | 1 row | torch | forced | GPT2KIT_F32_KERNEL is set |" \
        in done.stdout, done.stdout


@pytest.mark.parametrize("kernel", NATIVE)
def test_the_result_does_not_depend_on_the_thread_count(kernel):
    """The kernel's parts and column groups sum each output the same way on any number of threads
    (csrc/solo.h's fallback to one thread relies on it)."""
    _runs(kernel)
    fn, isa = native.f32_linear(), native.F32_ISAS[kernel.removeprefix("native-")]
    g = torch.Generator().manual_seed(3)
    for k_in, n_out, rows in ((768, 2304, 1), (3072, 768, 1), (100, 1001, 3), (7, 50, 2)):
        wt = torch.randn(k_in, n_out, generator=g)
        x, b = torch.randn(rows, k_in, generator=g), torch.randn(n_out, generator=g)
        ys = []
        for threads in (1, 2, 3, 4, 5):
            y = torch.empty(rows, n_out)
            fn(x.data_ptr(), rows, k_in, wt.data_ptr(), n_out, n_out, b.data_ptr(), y.data_ptr(), threads, isa)
            ys.append(y)
        assert all(torch.equal(ys[0], y) for y in ys[1:]), (k_in, n_out, rows)
        assert torch.allclose(ys[0], x @ wt + b, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("flags, no_native, want", [
    ("fpu sse2 avx2 fma", None, "native-avx2"),  # AVX2-only: the C kernel from the first run
    ("fpu sse2 avx2 fma", "1", "torch"),  # ... unless it cannot be built here
    ("fpu sse2 avx2 fma avx512f", None, "torch"),  # AVX-512: torch, until measured otherwise
])
def test_the_family_default_is_what_a_disturbed_or_missing_measurement_keeps(tmp_path, flags, no_native, want):
    code = """
import json, torch
from gpt2kit.decode import f32
mats = [(torch.randn(16, 40).t(), torch.randn(40)), (torch.randn(16, 90).t(), None)]
c = f32.decide_for("16x1x90", mats)
print(json.dumps([f32.default_kernel(), c.kernel, c.source]))
"""
    if want != "torch" and native.why_f32_unavailable("avx2") is not None:
        pytest.skip(f"the native kernel cannot run here: {native.why_f32_unavailable('avx2')}")
    disturbed = [1e-3, 5e-3, 1e-3, 5e-3, 1e-3]  # spread far beyond the noise allowed: the measurement decides nothing
    env = {"GPT2KIT_CPU_FLAGS": flags,
           "GPT2KIT_KERNEL_TIMINGS": json.dumps({k: disturbed for k in ("torch", "native-avx2", "native-avx512")})}
    if no_native:
        env["GPT2KIT_NO_NATIVE"] = no_native
    done = _run(code, tmp_path, **env)
    assert done.returncode == 0, done.stderr
    default, kernel, source = json.loads(done.stdout)
    assert default == want and kernel == want and source == "default"
