"""Differential attention: each head is the difference of two softmax maps, `(A1 - λ·A2) V`.

Paper: Ye et al. 2024, "Differential Transformer" (arXiv 2410.05258). What differs from MHA: a head has two query
maps and two key maps of width d and one value of width 2d. Its attention is the difference of the two softmax maps,
`softmax(Q1 K1ᵀ/√d) - λ softmax(Q2 K2ᵀ/√d)`, so that attention noise common to both cancels. λ is learned through the
paper's reparameterisation, `λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init`, with one set of four d-vectors per layer and
`λ_init = 0.8 - 0.6·exp(-0.3·(l - 1))` at layer l (1-based). Each head's output goes through its own RMSNorm (the
paper's per-head GroupNorm), scaled by `1 - λ_init`, before the output projection (`differential_head_norm=False`
leaves both out, as the paper's ablation without GroupNorm does). Deviation from the paper's code: the norm's affine
scale starts at a value's RMS at init, `min(1, initializer_range·sqrt(hidden_size))`, not at 1 — the same at the
paper's widths, and the difference between gqa's perplexity and twice it at width 128 (`head_norm_init`).

Sizes: `head_dim` is a head's width as transformers counts it, the width of its value and of its cache, 2d: its two
query/key maps are `head_dim / 2` wide each (the paper's code calls that half `head_dim`). It defaults to
`hidden_size / num_attention_heads`, so queries, keys and values have the widths of MHA's and the parameter count
matches; the paper's choice is half the heads of a Transformer at the same map width (the presets: 2, 3 and 6 heads
for widths 64, 384 and 768). Key/value heads are shared by groups of query heads as in GQA (`num_key_value_heads`):
head h reads key/value head h // (H / G) in both maps.

Kernel: both maps go through transformers' `ALL_ATTENTION_FUNCTIONS` (eager and sdpa; `backend_attention` pads the
d-wide queries and keys with zero channels for sdpa, whose fused kernel wants values as wide). Attention weights
(`output_attentions`, eager) are `A1 - λ·A2`: their rows sum to `1 - λ`, not 1.
Positions: RoPE rotates the d-wide maps; ALiBi, absolute positions and none work as for MHA.

Cache per token: keys of both maps and values, 2·L·G·head_dim values (MHA's at the same head_dim); a key/value head's
two key maps are cached side by side, as wide as its value, so every transformers cache sized from the config
(static caches, PEFT's prefix tuning) holds it. Deviation from the paper: for GQA (G < H) the official code makes
both maps of a head read the same key head; here map i of head h reads map i of key/value head h // (H / G), so the
two maps stay distinct.
"""

import math
from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import repeat_kv

from .compat_zoo import update_cache
from .configuration_zoo import ZooConfig, sized
from .heads_zoo import variant_heads
from .layers_zoo import ZooRMSNorm
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .positions_zoo import apply_rotary
from .seq2seq_zoo import seq2seq_classes


class ZooDifferentialConfig(ZooConfig):
    """`head_dim` is a head's value (and cache) width, its two query/key maps `head_dim / 2` wide each.
    `differential_head_norm`: each head's RMSNorm and its 1 - λ_init scale (the paper's; False for its ablation
    without GroupNorm, the heads' outputs as they are)."""

    model_type = "zoo_differential"
    paper = 'Ye et al. 2024, "Differential Transformer"'
    arxiv = ("2410.05258",)
    description = "two softmax maps per head, (A1 - λ·A2)V with a learned λ, per-head RMSNorm (Ye 2024)"
    cache_per_token = "2·L·G·d_h"
    presets = sized(num_attention_heads=(2, 3, 6))

    differential_head_norm: bool = True

    def _check_variant(self) -> None:
        rope = self.position_embedding_type == "rope"
        multiple = 4 if rope else 2
        if self.head_dim % multiple != 0:
            rotated = ", which RoPE rotates in pairs" if rope else ""
            raise ValueError(
                f"head_dim={self.head_dim} must be a multiple of {multiple}: a differential head has two query/key "
                f"maps of head_dim / 2 channels each{rotated}; choose hidden_size and num_attention_heads (or "
                f"head_dim) accordingly."
            )


def head_norm_init(config: ZooDifferentialConfig) -> float:
    """The head norm's scale at initialisation: the RMS a value has at init, `initializer_range·sqrt(hidden_size)`,
    at most 1. The paper's code starts the scale at 1 at widths (2,048 to 3,072, std about 0.02) where a value's RMS
    is about 1 anyway, so the norm leaves each head's output at a value's scale. At width 128 a value's RMS is 0.23:
    a scale of 1 makes every attention branch write 20 times what MHA's does into a residual stream of RMS 0.02,
    drowning the token embeddings, and the model trained to twice gqa's perplexity (docs/studies/quality.md)."""
    return min(1.0, config.initializer_range * math.sqrt(config.hidden_size))


class ZooDifferentialAttention(ZooMultiHeadAttention):
    """Queries and keys of two maps per head (`(B, 2H, T, d)`, `(B, 2G, T, d)`: map i of head h at 2h + i, d =
    head_dim / 2), values `(B, G, T, head_dim)`; the two maps through the backend, subtracted with the layer's λ,
    normalised per head. The cache holds a key/value head's two key maps side by side, `(B, G, T, head_dim)`, as wide
    as its value."""

    family = "differential"
    # values and output as the parent's; a head's two query/key maps of head_dim / 2 (RoPE on each) match no part
    # of the parent's one map: fresh, as are λ and the head norm
    parent_weights = ("v_proj", "o_proj")
    native_format = None  # no transformers architecture computes it
    gguf_architecture = None
    backends = ("eager", "sdpa")
    compiles_fullgraph = False  # not run compiled in this project
    attention_weights_sum_to_one = False  # rows of A1 - λ·A2 sum to 1 - λ
    maps_per_head = 2
    sized_by: ClassVar[dict[str, str]] = {
        "q_proj": "num_attention_heads, head_dim (two maps), hidden_size",
        "k_proj": "num_key_value_heads, head_dim (two maps), hidden_size",
        "v_proj": "num_key_value_heads, head_dim, hidden_size",
        "o_proj": "num_attention_heads, head_dim, hidden_size",
        **dict.fromkeys(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"), "head_dim (a map: head_dim / 2)"),
        "head_norm": "head_dim",
    }

    @classmethod
    def rotary_dim(cls, config: ZooDifferentialConfig) -> int:
        return config.head_dim // 2  # each map rotates on its own

    @classmethod
    def mixing_flops_per_token(cls, config: ZooDifferentialConfig, seq_len: int) -> float:
        # two maps per head, each scoring on head_dim / 2 channels and weighting the head_dim-wide value:
        # 2 · (2·d/2 + 2·d) = 6·d per head and key, against MHA's 4·d
        return 6 * config.num_attention_heads * config.head_dim * seq_len

    def __init__(self, config: ZooDifferentialConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)  # GQA projections at head_dim: each head's two maps side by side
        self.map_dim = self.head_dim // 2
        self.scaling = self.map_dim**-0.5  # a map's scores are d-wide dot products
        # λ's reparameterisation: four d-vectors per layer, and λ_init by depth (layer l = layer_idx + 1)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.empty(self.map_dim)) for _ in range(4)
        )
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        self.head_norm = ZooRMSNorm(self.value_dim, eps=config.rms_norm_eps) if config.differential_head_norm else None

    def init_parameters(self, config: ZooDifferentialConfig) -> None:
        for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            init.normal_(vector, mean=0.0, std=0.1)  # the paper's initialisation
        if self.head_norm is not None:
            init.constant_(self.head_norm.weight, head_norm_init(config))

    def differential_lambda(self) -> torch.Tensor:
        """λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init, a scalar."""
        first = torch.exp(torch.dot(self.lambda_q1, self.lambda_k1).float())
        second = torch.exp(torch.dot(self.lambda_q2, self.lambda_k2).float())
        return first - second + self.lambda_init

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length = hidden_states.shape[:2]
        # (B, T, heads * 2d) -> (B, T, 2 * heads, d) -> (B, 2 * heads, T, d): map i of head h is channel 2h + i
        query = self.q_proj(hidden_states).view(batch, length, -1, self.map_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(batch, length, -1, self.map_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, G, T, 2d)
        if position_embeddings is not None:
            query, key = apply_rotary(query, key, *position_embeddings)  # both maps rotate alike
        # (B, 2G, T, d) -> (B, T, 2G, d) -> (B, T, G, 2d) -> (B, G, T, 2d): maps 2g and 2g + 1 side by side
        key = key.transpose(1, 2).reshape(batch, length, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            # (B, G, S, 2d) each
            key, value = update_cache(cache, key, value, self.layer_idx, kwargs)

        maps = [
            self.attend(
                query[:, i::2],  # (B, H, T, d): map i of every head
                key[..., i * self.map_dim : (i + 1) * self.map_dim],  # (B, G, S, d): map i of every key head
                value,
                attention_mask,
                **kwargs,
            )
            for i in (0, 1)
        ]  # each ((B, T, H, 2d), weights (B, H, T, S) or None)
        lam = self.differential_lambda().to(query.dtype)
        weights = None
        if kwargs.get("output_attentions") and maps[0][1] is not None:
            # the weights asked for are the ones the output is computed from, so they carry gradients as eager's do
            weights = maps[0][1] - lam * maps[1][1]  # (B, H, T, S)
            output = torch.matmul(weights, repeat_kv(value, self.num_key_value_groups)).transpose(1, 2)
        else:
            output = maps[0][0] - lam * maps[1][0]  # (A1 - λ·A2) V, the value product being linear
        if self.head_norm is not None:
            output = self.head_norm(output) * (1.0 - self.lambda_init)  # per-head RMSNorm, as the paper's GroupNorm
        return self.o_proj(output.reshape(batch, length, -1)), weights


class ZooDifferentialModel(ZooModel):
    config_class = ZooDifferentialConfig
    attention_class = ZooDifferentialAttention


(
    ZooDifferentialForCausalLM,
    ZooDifferentialForSequenceClassification,
    ZooDifferentialForTokenClassification,
    ZooDifferentialForQuestionAnswering,
) = variant_heads(ZooDifferentialModel)
(
    ZooDifferentialEncoder,
    ZooDifferentialDecoder,
    ZooDifferentialSeq2SeqModel,
    ZooDifferentialForConditionalGeneration,
) = seq2seq_classes(ZooDifferentialModel)
