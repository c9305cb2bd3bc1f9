"""The fast CPU decode path, beside the spec (model.py): speed lives here, as gpt-fast keeps it out
of its model file.

- step.py      prefill, the flat one-token decode step and its few-token form (a speculative step's
               verify), with a kernel set chosen by kernels_for
- bind.py      the model's tensors resolved once per kernel set, re-bound when the model changes
- kernels.py   the plain kernel set: few-row products, measured per machine for half precision
- packed.py    the oneDNN-prepacked kernel set, with the GELU and residual adds fused
- layout.py    use_decode_layout: the weight layout decode kernels read fastest, large matrices on
               huge pages (applied at load)
- int8.py      the int8 weight products (gpt2kit.quant.modules's modules call them), kernel measured per process
- int8act.py   the opt-in int8-activation products (int8 x int8 in int32), kernel chosen per rows bucket
- f32.py       single float32 rows: F.linear or gpt2kit's own kernel, chosen per machine
- native_step.py  the batch-1 step as one C call (csrc/step.c) where every product is on a native kernel
- native.py    gpt2kit's own kernels (csrc/int8_linear.c, csrc/int8act_linear.c, csrc/f32_linear.c,
               csrc/step.c), built on first use

Each is proven equal to the spec by tests: the step against model.forward in tests/test_model.py
(test_decode_step_equals_forward), the packed set against the plain one in tests/test_packed.py,
the int8 kernels against the dequantized product in tests/test_quant.py, the int8-activation kernels
against the test's own formulation of their arithmetic in tests/test_int8act.py, the float32 kernel
against F.linear in tests/test_decode_f32.py, the native step against the Python step in
tests/test_decode_native_step.py, the binding against every kind of model change in
tests/test_decode_bind.py.
"""

from gpt2kit.decode.kernels import PLAIN, PlainKernels
from gpt2kit.decode.layout import use_decode_layout
from gpt2kit.decode.packed import PackedWeights, is_packed, packed_weights, release
from gpt2kit.decode.step import Kernels, decode_step, decode_tokens, kernels_for, prefill

__all__ = ["PLAIN", "Kernels", "PackedWeights", "PlainKernels", "decode_step", "decode_tokens", "is_packed",
           "kernels_for", "packed_weights", "prefill", "release", "use_decode_layout"]
