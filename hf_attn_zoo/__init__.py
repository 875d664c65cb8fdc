"""hf_attn_zoo: classic attention variants as transformers models.

`import hf_attn_zoo` registers every variant with transformers' Auto classes, so `AutoConfig.for_model("zoo_gqa")`,
`AutoModelForCausalLM.from_config(...)`, `from_pretrained` and `pipeline("text-generation")` work with them.
"""

from .models import VARIANTS, ZooConfig, ZooForCausalLM, ZooModel, ZooVariant, get_variant

__version__ = "0.1.0"

__all__ = ["VARIANTS", "ZooConfig", "ZooForCausalLM", "ZooModel", "ZooVariant", "__version__", "get_variant"]
