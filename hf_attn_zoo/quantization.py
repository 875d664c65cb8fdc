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

optimum-quanto compiles a C++ extension for CPU tensors the first time it is used (into its own package folder, so
once per installation, about a minute and a half on 2 cores), which needs a C++ compiler. `quantized_cache_kwargs`
builds it up front for a model on CPU: one logged line before the wait, and a one-line error naming what to install
when the compiler is missing, instead of a silent first `generate()` or a compiler traceback in the middle of it.

Both need the `quant` extra (torchao, optimum-quanto): `pip install -e ".[quant]"` in a clone of hf_attn_zoo.
"""

import logging
import shutil
from pathlib import Path

import torch
from torch import nn
from torch.utils import cpp_extension
from transformers import PreTrainedModel, TorchAoConfig

logger = logging.getLogger(__name__)

INT8_MODES = ("weight_only", "dynamic")


def _torchao_config(mode: str):
    if mode not in INT8_MODES:
        raise ValueError(f"mode={mode!r} is not an int8 scheme; use one of {list(INT8_MODES)}.")
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    except ImportError as error:
        raise ImportError('int8 weights need torchao: pip install -e ".[quant]" in a clone of hf_attn_zoo') from error
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
        raise ImportError(
            'a quantized cache needs optimum-quanto: pip install -e ".[quant]" in a clone of hf_attn_zoo'
        ) from error
    if nbits not in (2, 4):
        raise ValueError(f"nbits={nbits}: the quanto cache stores 2- or 4-bit integers; use 2 or 4.")
    if model.device.type == "cpu":
        build_quanto_cpu_extension()
    return {
        "cache_implementation": "quantized",
        "cache_config": {
            "backend": "quanto",
            "nbits": nbits,
            "q_group_size": model.config.head_dim,
            "residual_length": residual_length,
        },
    }


def _quanto_cpu_extension():
    from optimum.quanto.library.extensions import get_extension

    return get_extension("quanto_cpp")


def quanto_cpu_extension_is_built() -> bool:
    """Whether optimum-quanto's C++ extension is loaded, or built for this torch (what quanto checks before it
    rebuilds: the torch version it writes beside the library once a build has loaded)."""
    extension = _quanto_cpu_extension()
    if extension._lib is not None:
        return True
    version_file = Path(extension.build_directory) / "pytorch_version.txt"
    return version_file.is_file() and version_file.read_text().strip() == torch.__version__


def build_quanto_cpu_extension() -> None:
    """Build (or load) optimum-quanto's C++ extension for CPU tensors now, rather than inside the first `generate()`.

    A build logs one warning first, since it takes a minute or more; a missing C++ compiler or ninja raises a
    `RuntimeError` naming what to install before anything is compiled."""
    extension = _quanto_cpu_extension()
    if extension._lib is not None:
        return
    if not quanto_cpu_extension_is_built():
        # the compiler torch.utils.cpp_extension will call: $CXX, else c++
        compiler = cpp_extension.get_cxx_compiler()
        if shutil.which(compiler) is None:
            raise RuntimeError(
                f"optimum-quanto compiles a C++ extension for the quantized cache on first use, and the C++ compiler "
                f"{compiler!r} (from $CXX, else c++) is not on PATH: install one (Debian/Ubuntu: apt-get install g++) "
                f"or set CXX to it."
            )
        if not cpp_extension.is_ninja_available():
            raise RuntimeError(
                "optimum-quanto compiles a C++ extension for the quantized cache on first use, with ninja, which is "
                "not on PATH: pip install ninja"
            )
        logger.warning(
            "optimum-quanto is compiling its C++ extension for the quantized cache, once per "
            "installation (about 1.5 minutes on 2 CPU cores)..."
        )
    extension.lib  # noqa: B018 (the property builds or loads the library)
