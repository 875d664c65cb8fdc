"""Conversions between zoo checkpoints and transformers' own models."""

from .llama import from_llama, to_llama, zoo_config_from_llama

__all__ = ["from_llama", "to_llama", "zoo_config_from_llama"]
