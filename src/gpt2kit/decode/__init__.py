"""The fast CPU decode path, beside the spec (model.py): speed lives here, as gpt-fast keeps it out
of its model file.

- path.py      kernels_for: the one place that picks how a model's steps run (the spec's forward,
               the flat loop on a kernel set, or the whole step in C) and the Kernels that says it,
               holding the bound tensors and checking them once per step
- step.py      prefill, the one-token decode step and its few-token form (a speculative step's
               verify): one flat loop over the blocks, on the path a Kernels says
- bind.py      KernelSet (what a kernel set gives the loop) and the model's tensors resolved once
               for one (Binding), bound again when the model changes
- plain.py     the plain kernel set: few-row products, measured per machine for half precision
- packed.py    the oneDNN-prepacked kernel set, with the GELU and residual adds fused
- layout.py    use_decode_layout: the weight layout decode kernels read fastest, large matrices on
               huge pages (applied at load)
- int8.py      the int8 weight products (gpt2kit.quant.modules's modules call them), kernel measured per process
- int8act.py   the opt-in int8-activation products (int8 x int8 in int32), kernel chosen per rows bucket
- f32.py       single float32 rows: F.linear or gpt2kit's own kernel, chosen per machine
- native_step.py  the batch-1 step as one C call (csrc/step.c) where every product is on a native kernel
- native.py    gpt2kit's own kernels (csrc/int8_linear.c, csrc/int8act_linear.c, csrc/f32_linear.c,
               csrc/step.c), built on first use

Each is proven equal to the spec by tests: the flat loop against model.forward in tests/test_model.py
(test_decode_step_equals_forward, test_decode_tokens_equals_forward), the packed set against the plain
one in tests/test_packed.py, the int8 kernels against the dequantized product in tests/test_quant.py,
the int8-activation kernels against the test's own formulation of their arithmetic in
tests/test_int8act.py, the float32 kernel against F.linear in tests/test_decode_f32.py, the native step
against the flat loop in tests/test_decode_native_step.py, the binding against every kind of model
change in tests/test_decode_bind.py.
"""

from gpt2kit.decode.bind import KernelSet
from gpt2kit.decode.layout import use_decode_layout
from gpt2kit.decode.packed import PackedWeights, is_packed, packed_weights, release
from gpt2kit.decode.path import FORWARD, PLAIN, Kernels, kernels_for
from gpt2kit.decode.plain import PlainKernels
from gpt2kit.decode.step import decode_step, decode_tokens, prefill, prefill_ragged

__all__ = ["FORWARD", "PLAIN", "KernelSet", "Kernels", "PackedWeights", "PlainKernels", "decode_step",
           "decode_tokens", "is_packed", "kernels_for", "packed_weights", "prefill", "prefill_ragged", "release",
           "use_decode_layout"]
