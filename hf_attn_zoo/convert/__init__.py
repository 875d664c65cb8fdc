"""Conversions: Llama-family <-> zoo, Mamba <-> zoo, key/value head pooling (MHA -> GQA/MQA), MHA/GQA -> MLA, any
zoo variant from an MHA-family parent with attention transfer, distillation losses, GGUF files."""

from .distill import distillation_loss, precompute_teacher_topk, topk_distillation_loss
from .latent import MLA_METHODS, to_mla
from .llama import from_llama, from_mistral, to_llama, to_native, zoo_config_from_llama
from .mamba import from_mamba, to_mamba
from .pooling import METHODS, mha_to_gqa, seq2seq_mha_to_gqa
from .transfer import Conversion, LayerTransfer, attention_transfer, convert_attention, seq2seq_attention_transfer

__all__ = [
    "METHODS",
    "MLA_METHODS",
    "Conversion",
    "LayerTransfer",
    "attention_transfer",
    "convert_attention",
    "distillation_loss",
    "from_llama",
    "from_mamba",
    "from_mistral",
    "mha_to_gqa",
    "precompute_teacher_topk",
    "seq2seq_attention_transfer",
    "seq2seq_mha_to_gqa",
    "to_llama",
    "to_mamba",
    "to_mla",
    "to_native",
    "topk_distillation_loss",
    "zoo_config_from_llama",
]
