"""int8 as module swaps on the spec: the scheme and its modules (modules.py) and the quality gate that
admits int8 activations per model (gate.py). The products themselves are gpt2kit.decode.int8's."""

from gpt2kit.quant.modules import (
    ACTIVATIONS,
    SCALE_DTYPES,
    SCHEMES,
    QuantEmbedding,
    QuantLinear,
    activations,
    check_scheme,
    is_quantized,
    parameter_count,
    quality,
    quantization,
    quantize_model,
    quantize_weight,
    quantized_skeleton,
    set_activations,
    weight_bytes,
)

__all__ = ["ACTIVATIONS", "SCALE_DTYPES", "SCHEMES", "QuantEmbedding", "QuantLinear", "activations", "check_scheme",
           "is_quantized", "parameter_count", "quality", "quantization", "quantize_model", "quantize_weight",
           "quantized_skeleton", "set_activations", "weight_bytes"]
