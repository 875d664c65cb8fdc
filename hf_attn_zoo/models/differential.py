"""Differential attention: each head is the difference of two softmax maps, `(A1 - λ·A2) V`.

Paper: Ye et al. 2024, "Differential Transformer" (arXiv 2410.05258). What differs from MHA: a head has two query
maps and two key maps of width d (`head_dim`) and one value of width 2d. Its attention is the difference of the two
softmax maps, `softmax(Q1 K1ᵀ/√d) - λ softmax(Q2 K2ᵀ/√d)`, so that attention noise common to both cancels. λ is
learned through the paper's reparameterisation, `λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init`, with one set of four
d-vectors per layer and `λ_init = 0.8 - 0.6·exp(-0.3·(l - 1))` at layer l (1-based). Each head's output goes through
its own RMSNorm (the paper's per-head GroupNorm), scaled by `1 - λ_init`, before the output projection
(`differential_head_norm=False` leaves both out, as the paper's ablation without GroupNorm does).

Sizes: `head_dim` d defaults to `hidden_size / (2·num_attention_heads)`, so queries, keys and values have the
widths of MHA's and the parameter count matches; the paper's choice is half the heads of a Transformer at the same
head width (the presets: 2, 3 and 6 heads for widths 64, 384 and 768). Key/value heads are shared by groups of query
heads as in GQA (`num_key_value_heads`): head h reads key/value head h // (H / G) in both maps.

Kernel: both maps go through transformers' `ALL_ATTENTION_FUNCTIONS` (eager and sdpa; `backend_attention` pads the
d-wide queries and keys with zero channels for sdpa, whose fused kernel wants values as wide). Attention weights
(`output_attentions`, eager) are `A1 - λ·A2`: their rows sum to `1 - λ`, not 1.
Positions: RoPE rotates the d-wide maps; ALiBi, absolute positions and none work as for MHA.

Cache per token: keys of both maps and values, 2·L·G·2d values (twice MHA's at the same head_dim; the same as MHA
with heads of width 2d); a key/value head's two key maps are cached side by side. Deviation from the paper: for GQA
(G < H) the official code makes both maps of a head read the same key head; here map i of head h reads map i of
key/value head h // (H / G), so the two maps stay distinct.
"""

import math
from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.models.llama.modeling_llama import repeat_kv

from .compat_zoo import update_cache
from .configuration_zoo import ZooConfig, sized
from .mha import ZooMultiHeadAttention
from .modeling_zoo import (
    ZooForCausalLM,
    ZooForQuestionAnswering,
    ZooForSequenceClassification,
    ZooForTokenClassification,
    ZooModel,
    ZooRMSNorm,
)
from .positions_zoo import apply_rotary


class CachedHeadWidth:
    """A differential layer's config as transformers reads it to size a static key/value cache (`get_head_shapes`
    reads `head_dim` off each of `config.per_layer_config`): a cached key/value head is 2·head_dim wide (module
    docstring). Every other field is the config's."""

    def __init__(self, config: ZooConfig) -> None:
        self._config = config

    @property
    def head_dim(self) -> int:
        return 2 * self._config.head_dim

    def __getattr__(self, name: str):
        return getattr(self._config, name)


class ZooDifferentialConfig(ZooConfig):
    """`head_dim` is the width d of each query/key map; values are 2d wide. `differential_head_norm`: each head's
    RMSNorm and its 1 - λ_init scale (the paper's; False for its ablation without GroupNorm, the heads' outputs as
    they are)."""

    model_type = "zoo_differential"
    paper = 'Ye et al. 2024, "Differential Transformer"'
    arxiv = ("2410.05258",)
    description = "two softmax maps per head, (A1 - λ·A2)V with a learned λ, per-head RMSNorm (Ye 2024)"
    cache_per_token = "2·L·G·2d_h"
    presets = sized(num_attention_heads=(2, 3, 6))

    differential_head_norm: bool = True

    def __post_init__(self, **kwargs):
        heads, hidden = self.num_attention_heads, self.hidden_size
        if self.head_dim is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
            if hidden % (2 * heads) != 0:
                raise ValueError(
                    f"hidden_size={hidden} is not divisible by 2 * num_attention_heads={2 * heads}: each head has two "
                    f"query/key maps of width head_dim = hidden_size / (2 * num_attention_heads); pick a head count "
                    f"that divides hidden_size / 2, or set head_dim explicitly."
                )
            self.head_dim = hidden // (2 * heads)
        super().__post_init__(**kwargs)

    @property
    def per_layer_config(self):
        """The layers' configs, each reporting the cached head width: static caches built from the config (the
        ExecuTorch exporter's, `generate`'s with chunked prefill) are allocated 2·head_dim wide, as the layers
        write them. Heterogeneous configs (per-layer overrides) are transformers' own."""
        if self.is_heterogeneous:
            return ZooConfig.per_layer_config.fget(self)
        return [CachedHeadWidth(self)] * self.num_hidden_layers  # no call into the property: torch.compile traces this

    @per_layer_config.setter
    def per_layer_config(self, per_layer_config) -> None:
        ZooConfig.per_layer_config.fset(self, per_layer_config)


class ZooDifferentialAttention(ZooMultiHeadAttention):
    """Queries and keys of two maps per head (`(B, 2H, T, d)`, `(B, 2G, T, d)`: map i of head h at 2h + i), values
    `(B, G, T, 2d)`; the two maps through the backend, subtracted with the layer's λ, normalised per head. The cache
    holds a key/value head's two key maps side by side, `(B, G, T, 2d)`, as wide as its value (transformers' static
    cache wants keys and values with the same heads)."""

    family = "differential"
    backends = ("eager", "sdpa")
    compiles_fullgraph = False  # not run compiled in this project
    attention_weights_sum_to_one = False  # rows of A1 - λ·A2 sum to 1 - λ
    sized_by: ClassVar[dict[str, str]] = {
        "q_proj": "num_attention_heads, head_dim (two maps), hidden_size",
        "k_proj": "num_key_value_heads, head_dim (two maps), hidden_size",
        "v_proj": "num_key_value_heads, head_dim (values are 2 * head_dim wide), hidden_size",
        "o_proj": "num_attention_heads, head_dim (2 * head_dim per head), hidden_size",
        **dict.fromkeys(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"), "head_dim"),
        "head_norm": "head_dim (2 * head_dim)",
    }

    @classmethod
    def continuous_batching_refusal(cls, config: ZooDifferentialConfig) -> str:
        # each of its two attention calls would write the layer's keys into the paged cache, the second over the first
        return "it runs two attention maps per layer, and transformers' paged cache holds one per layer"

    @classmethod
    def kv_compression_refusal(cls, config: ZooDifferentialConfig) -> str:
        # unrefused on kvpress 0.5, ExpectedAttention and SnapKV fail reshaping q_proj's output into one query a head
        return (
            "each head attends with two query/key maps (A1 - λ·A2; q_proj and k_proj twice as wide, keys cached "
            "2·head_dim wide), so presses that rebuild one RoPE query per head from q_proj (ExpectedAttention, "
            "SnapKV) do not apply; refused for every press"
        )

    @classmethod
    def query_key_width(cls, config: ZooDifferentialConfig) -> int:
        return 2 * config.head_dim  # a head's two maps, side by side

    @classmethod
    def value_width(cls, config: ZooDifferentialConfig) -> int:
        return 2 * config.head_dim

    @classmethod
    def rotary_dim(cls, config: ZooDifferentialConfig) -> int:
        return config.head_dim  # each map rotates on its own

    def __init__(self, config: ZooDifferentialConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)  # GQA projections at the widths above
        self.scaling = self.head_dim**-0.5  # a map's scores are d-wide dot products
        # λ's reparameterisation: four d-vectors per layer, and λ_init by depth (layer l = layer_idx + 1)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.empty(self.head_dim)) for _ in range(4)
        )
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        self.head_norm = ZooRMSNorm(self.value_dim, eps=config.rms_norm_eps) if config.differential_head_norm else None

    def init_parameters(self, config: ZooDifferentialConfig) -> None:
        for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            init.normal_(vector, mean=0.0, std=0.1)  # the paper's initialisation

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
        query = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(batch, length, -1, 2 * self.head_dim).transpose(1, 2)  # (B, G, T, 2d)
        if position_embeddings is not None:
            query, key = apply_rotary(query, key, *position_embeddings)  # both maps rotate alike
        # (B, 2G, T, d) -> (B, T, 2G, d) -> (B, T, G, 2d) -> (B, G, T, 2d): maps 2g and 2g + 1 side by side
        key = key.transpose(1, 2).reshape(batch, length, -1, 2 * self.head_dim).transpose(1, 2)
        if cache is not None:
            # (B, G, S, 2d) each
            key, value = update_cache(cache, key, value, self.layer_idx, kwargs)

        maps = [
            self.attend(
                query[:, i::2],  # (B, H, T, d): map i of every head
                key[..., i * self.head_dim : (i + 1) * self.head_dim],  # (B, G, S, d): map i of every key head
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


class ZooDifferentialForCausalLM(ZooForCausalLM, GenerationMixin):
    base_model_class = ZooDifferentialModel


class ZooDifferentialForSequenceClassification(ZooForSequenceClassification):
    base_model_class = ZooDifferentialModel


class ZooDifferentialForTokenClassification(ZooForTokenClassification):
    base_model_class = ZooDifferentialModel


class ZooDifferentialForQuestionAnswering(ZooForQuestionAnswering):
    base_model_class = ZooDifferentialModel
