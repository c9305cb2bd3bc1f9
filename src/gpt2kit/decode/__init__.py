"""The fast CPU decode path, beside the spec (model.py): speed lives here, as gpt-fast keeps it out
of its model file.

- step.py      prefill and the flat one-token decode step, with a kernel set chosen by kernels_for
- kernels.py   the plain kernel set: few-row products, measured per machine for half precision
- packed.py    the oneDNN-prepacked kernel set, with the GELU and residual adds fused
- layout.py    use_decode_layout: the weight layout decode kernels read fastest (applied at load)

Each is proven equal to model.forward by tests (tests/test_decode.py).
"""

from gpt2kit.decode.kernels import PLAIN, PlainKernels
from gpt2kit.decode.layout import use_decode_layout
from gpt2kit.decode.packed import PackedWeights, is_packed, packed_weights, release
from gpt2kit.decode.step import Kernels, decode_step, kernels_for, prefill

__all__ = ["PLAIN", "Kernels", "PackedWeights", "PlainKernels", "decode_step", "is_packed", "kernels_for",
           "packed_weights", "prefill", "release", "use_decode_layout"]
