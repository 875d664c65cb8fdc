"""hf_attn_zoo: classic attention variants as transformers models.

`import hf_attn_zoo` registers every variant with transformers' Auto classes, so `AutoConfig.for_model("zoo_gqa")`,
`AutoModelForCausalLM.from_config(...)`, `from_pretrained` and `pipeline("text-generation")` work with them.
"""

import logging

# transformers imports torchao (the `quant` extra) whenever it is installed; on a CPU-only torch, torchao logs a
# warning for every CUDA kernel library it cannot load, and torch one for each enum torchao registers. Nothing here
# uses those kernels, so only errors from them are shown.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# after the logging set-up: importing the models imports transformers
from .models import VARIANTS, ZooConfig, ZooForCausalLM, ZooModel, ZooVariant, get_variant  # noqa: E402

__version__ = "0.1.0"

__all__ = ["VARIANTS", "ZooConfig", "ZooForCausalLM", "ZooModel", "ZooVariant", "__version__", "get_variant"]
