"""Conversions: Llama-family <-> zoo, key/value head pooling (MHA -> GQA/MQA), GGUF files."""

from .llama import from_llama, to_llama, zoo_config_from_llama
from .pooling import METHODS, mha_to_gqa

__all__ = ["METHODS", "from_llama", "mha_to_gqa", "to_llama", "zoo_config_from_llama"]
