"""int8 inference on CPU: torchao weight quantization and a quantized key/value cache, through transformers' own hooks.

Weights: torchao's `Int8WeightOnlyConfig` (int8 weights with a scale per output channel, dequantized inside the
matmul) or `Int8DynamicActivationInt8WeightConfig` (activations quantized per token at run time too, int8 x int8
matmuls). Either goes through `TorchAoConfig` at load time, the way transformers users quantize any model:

    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=int8_config())

or onto a model already in memory with `quantize_int8(model)`. The head is left in full precision: with tied
embeddings it is the embedding matrix, which a quantized copy would duplicate, and its logits set the perplexity.

Key/value cache: transformers' `QuantizedCache` with the optimum-quanto backend keeps the recent `residual_length`
tokens in full precision and the rest in `nbits` integers per group of `q_group_size` channels. It applies to
variants whose cache holds keys and values; the state-decoding variants (Linformer, AFT) refuse it.

Both need the `quant` extra: `pip install "hf-attn-zoo[quant]"` (torchao, optimum-quanto).
"""

from torch import nn
from transformers import PreTrainedModel, TorchAoConfig

INT8_MODES = ("weight_only", "dynamic")


def _torchao_config(mode: str):
    if mode not in INT8_MODES:
        raise ValueError(f"mode={mode!r} is not an int8 scheme; use one of {list(INT8_MODES)}.")
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    except ImportError as error:
        raise ImportError('int8 weights need torchao: pip install "hf-attn-zoo[quant]"') from error
    return Int8WeightOnlyConfig() if mode == "weight_only" else Int8DynamicActivationInt8WeightConfig()


def int8_config(mode: str = "weight_only") -> TorchAoConfig:
    """`quantization_config` for `from_pretrained`: every linear layer but the head in int8 (`mode` as above)."""
    return TorchAoConfig(_torchao_config(mode), modules_to_not_convert=["lm_head"])


def quantize_int8(model: PreTrainedModel, mode: str = "weight_only") -> PreTrainedModel:
    """Quantize the linear layers of `model` (all but the head) to int8 in place, and return it."""
    from torchao.quantization import quantize_

    head = model.get_output_embeddings()
    quantize_(
        model, _torchao_config(mode), filter_fn=lambda module, _: isinstance(module, nn.Linear) and module is not head
    )
    return model


def quantized_cache_kwargs(model: PreTrainedModel, nbits: int = 4, residual_length: int = 128) -> dict:
    """`generate()` keyword arguments for a quanto-quantized key/value cache; quantization groups are one head's
    channels, so every head gets its own scales."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError as error:
        raise ImportError('a quantized cache needs optimum-quanto: pip install "hf-attn-zoo[quant]"') from error
    if nbits not in (2, 4):
        raise ValueError(f"nbits={nbits}: the quanto cache stores 2- or 4-bit integers; use 2 or 4.")
    return {
        "cache_implementation": "quantized",
        "cache_config": {
            "backend": "quanto",
            "nbits": nbits,
            "q_group_size": model.config.head_dim,
            "residual_length": residual_length,
        },
    }
