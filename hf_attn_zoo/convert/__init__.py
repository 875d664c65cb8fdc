"""Conversions: Llama-family <-> zoo, key/value head pooling (MHA -> GQA/MQA), MHA/GQA -> MLA, GGUF files."""

from .latent import MLA_METHODS, to_mla
from .llama import from_llama, from_mistral, to_llama, to_native, zoo_config_from_llama
from .pooling import METHODS, mha_to_gqa

__all__ = [
    "METHODS",
    "MLA_METHODS",
    "from_llama",
    "from_mistral",
    "mha_to_gqa",
    "to_llama",
    "to_mla",
    "to_native",
    "zoo_config_from_llama",
]
