"""Multi-head latent attention (MLA): every head's keys and values are read off one low-rank latent per token.

Paper: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model" (section
2.1), with transformers' DeepSeek-V2 names for the fields and the projections. Per token x:

- queries: `q_proj(x)` (or `q_b_proj(q_a_layernorm(q_a_proj(x)))` with a `q_lora_rank`), per head a no-RoPE part of
  `qk_nope_head_dim` and a RoPE part of `qk_rope_head_dim`;
- `kv_a_proj_with_mqa(x)` gives the latent `c` of `kv_lora_rank` (then `kv_a_layernorm`) and one RoPE key of
  `qk_rope_head_dim` that every head shares (the "MQA" in the name);
- `kv_b_proj(c)` up-projects the latent into per-head no-RoPE keys (`qk_nope_head_dim`) and values (`v_head_dim`).

A head's score is `q_nopeᵀ k_nope + q_ropeᵀ k_rope`, scaled by `1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`.

Cache per token: `c` and the RoPE key, `L·(kv_lora_rank + qk_rope_head_dim)` values, whatever the head count. As in
transformers' DeepSeek-V2 the latent is cached as the "keys" `(B, 1, S, kv_lora_rank)` and the RoPE key as the
"values" `(B, 1, S, qk_rope_head_dim)` of a one-head layer.

Two exact ways to attend, chosen per forward:
- *expanded* (training, prefill, chunks of several tokens): up-project every visible latent into per-head keys and
  values and run softmax attention through transformers' `ALL_ATTENTION_FUNCTIONS` (eager, sdpa; for sdpa the
  values are padded with zero channels to the keys' width, as its fused kernel wants: `backend_attention`);
- *absorbed* (one-token decoding steps, the default there): `q_nopeᵀ (W_UK c) = (W_UKᵀ q_nope)ᵀ c` and
  `W_UV Σ p c = Σ p (W_UV c)`, so each head's query is folded into the latent's space and attends over the cached
  latents directly; the H heads become the H queries of one shared key/value head. The up-projection of the cache,
  O(S·kv_lora_rank·H·(qk_nope_head_dim + v_head_dim)) per step, is never done. Both paths are the same function
  (tested against each other and an uncached forward); `absorb_for_decoding=False` keeps the expanded one, and a
  wrapped `kv_b_proj` (a LoRA adapter) or a quantised weight (torchao's int8) also keeps it, since neither is one
  plain matrix to fold, and so does a weight that accelerate offloads (in place only inside `kv_b_proj`'s forward).

RoPE frequencies: by default the RoPE part rotates by its own ladder, `rope_theta^(-2i/qk_rope_head_dim)` (DeepSeek).
A model converted from a RoPE checkpoint (`hf_attn_zoo.convert.to_mla`) keeps, per layer, a chosen subset of the
parent's frequencies `rope_theta^(-2i/head_dim)`: `rope_frequencies[layer]` lists those i (MHA2MLA's partial RoPE).

Deviation from the paper: no YaRN `mscale` on the scaling (transformers' RoPE scaling types still apply to the
ladder); the backbone's choices otherwise (pre-norm, RMSNorm, dense MLP rather than DeepSeek's mixture of experts).
"""

from typing import ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat_zoo import update_cache
from .configuration_zoo import HEADS, ZooConfig, _is_positive_int, sized
from .heads_zoo import variant_heads
from .layers_zoo import ZooAttention, ZooRMSNorm
from .mha import backend_attention
from .modeling_zoo import ZooModel
from .positions_zoo import apply_rotary
from .seq2seq_zoo import seq2seq_classes


class ZooMLAConfig(ZooConfig):
    r"""Multi-head latent attention. Widths default from `head_dim` (`hidden_size / num_attention_heads`) in
    DeepSeek-V2's proportions (there `head_dim` 128, latent 512, RoPE part 64).

    Args:
        kv_lora_rank (`int`, *optional*): width of the cached latent; defaults to 4 * head_dim.
        q_lora_rank (`int`, *optional*): width of the queries' low-rank bottleneck; None projects queries directly.
        qk_nope_head_dim (`int`, *optional*): per-head query/key width without RoPE; defaults to head_dim. May be 0.
        qk_rope_head_dim (`int`, *optional*): query/shared-key width with RoPE; defaults to head_dim / 2. Even.
        v_head_dim (`int`, *optional*): per-head value width; defaults to head_dim.
        rope_frequencies (`list[list[int]]`, *optional*): per layer, the indices i < head_dim / 2 of the frequencies
            `rope_theta^(-2i/head_dim)` the RoPE part rotates by, qk_rope_head_dim / 2 of them (a conversion's choice);
            None: the RoPE part's own ladder.
        latent_norm (`bool`): RMSNorm on the latent (`kv_a_layernorm`, DeepSeek's); a conversion turns it off, since
            the parent's keys and values are linear in the latent only without it.
        absorb_for_decoding (`bool`): one-token steps attend over the cached latents with the up-projections folded
            into the query and the output (exact; cheaper than up-projecting the cache).
    """

    model_type = "zoo_mla"
    paper = 'DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model"'
    arxiv = ("2405.04434",)
    presets = sized(num_attention_heads=HEADS)
    description = "per-head keys and values up-projected from one cached low-rank latent, shared RoPE key (DeepSeek)"
    cache_per_token = "L·(r_kv + d_rope)"

    num_key_value_heads: int | None = 1  # the cache holds one latent "head" per token
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_frequencies: list[list[int]] | None = None
    latent_norm: bool = True
    absorb_for_decoding: bool = True

    def __post_init__(self, **kwargs):
        heads, hidden, head_dim = self.num_attention_heads, self.hidden_size, self.head_dim
        if head_dim is None and _is_positive_int(heads) and _is_positive_int(hidden) and hidden % heads == 0:
            head_dim = hidden // heads  # the backbone's default, which it sets (or refuses) itself
        if _is_positive_int(head_dim):
            for name, width in (
                ("kv_lora_rank", 4 * head_dim),
                ("qk_nope_head_dim", head_dim),
                ("qk_rope_head_dim", max(2, head_dim // 4 * 2)),  # half of head_dim, even
                ("v_head_dim", head_dim),
            ):
                if getattr(self, name) is None:
                    setattr(self, name, width)
        super().__post_init__(**kwargs)

    @property
    def qk_head_dim(self) -> int:
        """A query/key head's width; transformers reads this name to recognise MLA (keys and values of different
        widths) and leaves its static caches to size themselves from the first write."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _check_variant(self) -> None:
        if self.num_key_value_heads != 1:
            raise ValueError(
                f"{self.model_type} caches one latent per token shared by every head, got num_key_value_heads="
                f"{self.num_key_value_heads}; leave it unset (or 1) and size the cache with kv_lora_rank."
            )
        for name, meaning in (
            ("kv_lora_rank", "the width of the cached latent"),
            ("v_head_dim", "the width of a head's value"),
            ("qk_rope_head_dim", "the width of the queries' and the shared key's RoPE part"),
        ):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer: {meaning}.")
        nope = self.qk_nope_head_dim
        if not isinstance(nope, int) or isinstance(nope, bool) or nope < 0:
            raise ValueError(
                f"qk_nope_head_dim={nope!r} must be an integer >= 0: the per-head query/key width without RoPE."
            )
        if self.q_lora_rank is not None and not _is_positive_int(self.q_lora_rank):
            raise ValueError(
                f"q_lora_rank={self.q_lora_rank!r} must be a positive integer (the queries' bottleneck), or None to "
                f"project queries directly."
            )
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even: RoPE rotates pairs of channels.")
        for name in ("latent_norm", "absorb_for_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        self._check_rope_frequencies()

    def _check_rope_frequencies(self) -> None:
        chosen = self.rope_frequencies
        if chosen is None:
            return
        if self.position_embedding_type != "rope":
            raise ValueError(
                f"rope_frequencies select RoPE frequencies, but position_embedding_type="
                f"{self.position_embedding_type!r}; remove rope_frequencies or use position_embedding_type='rope'."
            )
        pairs, ladder = self.qk_rope_head_dim // 2, self.head_dim // 2
        if not isinstance(chosen, (list, tuple)) or len(chosen) != self.num_hidden_layers:
            raise ValueError(
                f"rope_frequencies must list one entry per layer (num_hidden_layers={self.num_hidden_layers}), got "
                f"{chosen!r}."
            )
        for layer, indices in enumerate(chosen):
            valid = isinstance(indices, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < ladder for i in indices
            )
            if not valid or len(indices) != pairs or len(set(indices)) != pairs:
                raise ValueError(
                    f"rope_frequencies[{layer}]={indices!r} must be {pairs} distinct frequency indices "
                    f"(qk_rope_head_dim / 2) in [0, {ladder}) (head_dim / 2): frequency i rotates by "
                    f"rope_theta^(-2i/head_dim)."
                )


class ZooMultiHeadLatentAttention(ZooAttention):
    """Queries `(B, H, T, nope + rope)`; the cache holds latents `(B, 1, S, kv_lora_rank)` and RoPE keys
    `(B, 1, S, rope)`; `attend_expanded` or `attend_absorbed` (module docstring) turns them into `(B, T, H, v)`."""

    family = "mla"
    parent_weights = None  # computed from the parent's q/k/v/o by `to_mla` (TransMLA / MHA2MLA)
    native_format = "deepseek_v3"  # all-dense DeepSeek-V3 with rope_interleave=False (hf_attn_zoo.convert.deepseek)
    gguf_architecture = "deepseek2"  # llama.cpp's MLA, every layer dense
    backends = ("eager", "sdpa")  # flash attention would take the padded values too; nothing here tests it
    compiles_fullgraph = True  # the path is chosen by the query length, a static shape
    caches = "a latent (kv_lora_rank) and a shared RoPE key (qk_rope_head_dim)"  # see `cached_widths`
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    sized_by: ClassVar[dict[str, str]] = {
        "q_proj": "num_attention_heads, qk_nope_head_dim + qk_rope_head_dim, hidden_size",
        "q_a_proj": "q_lora_rank, hidden_size",
        "q_a_layernorm": "q_lora_rank",
        "q_b_proj": "num_attention_heads, qk_nope_head_dim + qk_rope_head_dim, q_lora_rank",
        "kv_a_proj_with_mqa": "kv_lora_rank + qk_rope_head_dim, hidden_size",
        "kv_a_layernorm": "kv_lora_rank",
        "kv_b_proj": "num_attention_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank",
        "o_proj": "num_attention_heads, v_head_dim, hidden_size",
    }

    @classmethod
    def query_key_width(cls, config: ZooMLAConfig) -> int:
        return config.qk_head_dim

    @classmethod
    def value_width(cls, config: ZooMLAConfig) -> int:
        return config.v_head_dim

    @classmethod
    def mixing_flops_per_token(cls, config: ZooMLAConfig, seq_len: int) -> float:
        # the expanded form training runs: per head, scores over nope + rope channels and values of v_head_dim
        # (kv_b_proj's up-projection of the latent is a Linear on every token, counted with the parameters)
        widths = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
        return 2 * config.num_attention_heads * seq_len * widths

    @classmethod
    def rotary_dim(cls, config: ZooMLAConfig) -> int:
        # a conversion's subset of the parent's frequencies is gathered per layer from the parent's whole ladder
        return config.head_dim if config.rope_frequencies is not None else config.qk_rope_head_dim

    @classmethod
    def lora_modules(cls, config: ZooMLAConfig) -> tuple[str, ...]:
        if config.q_lora_rank is None:
            return cls.lora_targets
        return ("q_a_proj", "q_b_proj", *cls.lora_targets[1:])  # the queries' bottleneck replaces q_proj

    @classmethod
    def cached_widths(cls, config: ZooMLAConfig) -> tuple[int, int, int]:
        return 1, config.kv_lora_rank, config.qk_rope_head_dim  # the latent as keys, the RoPE key as values

    def __init__(self, config: ZooMLAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1  # the expanded path has one key/value head per query head
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.scaling = config.qk_head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.absorb_for_decoding = config.absorb_for_decoding
        hidden, bias, heads = config.hidden_size, config.attention_bias, self.num_heads
        query_width = heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, query_width, bias=bias)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = ZooRMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, query_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = ZooRMSNorm(self.latent_dim, eps=config.rms_norm_eps) if config.latent_norm else None
        self.kv_b_proj = nn.Linear(self.latent_dim, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        chosen = config.rope_frequencies is not None and config.position_embedding_type == "rope"
        self.register_buffer("rope_channels", self.chosen_channels(config) if chosen else None, persistent=False)

    def chosen_channels(self, config: ZooMLAConfig) -> torch.Tensor:
        """The (cos, sin) channels of this layer's chosen frequencies, `(rope,)`: transformers' layout repeats the
        ladder twice (channel i rotates with i + head_dim/2), so frequency i is channels i and i + head_dim/2."""
        chosen = torch.tensor(config.rope_frequencies[self.layer_idx])
        return torch.cat((chosen, chosen + config.head_dim // 2))

    def init_parameters(self, config: ZooMLAConfig) -> None:
        # `from_pretrained` builds on the meta device and leaves non-persistent buffers uninitialised
        if self.rope_channels is not None:
            self.rope_channels.copy_(self.chosen_channels(config))

    def queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`(B, T, d)` -> `(B, H, T, nope + rope)`."""
        if hasattr(self, "q_proj"):
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        # (B, T, H * (nope + rope)) -> (B, T, H, nope + rope) -> (B, H, T, nope + rope)
        return query.view(*hidden_states.shape[:-1], self.num_heads, -1).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length = hidden_states.shape[:2]
        query_nope, query_rope = self.queries(hidden_states).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, key_rope = self.kv_a_proj_with_mqa(hidden_states).split((self.latent_dim, self.rope_dim), dim=-1)
        if self.kv_a_layernorm is not None:
            latent = self.kv_a_layernorm(latent)
        latent = latent.unsqueeze(1)  # (B, T, r) -> (B, 1, T, r): one head for the cache
        key_rope = key_rope.unsqueeze(1)  # (B, 1, T, rope), shared by every head
        if position_embeddings is not None:
            cos, sin = position_embeddings  # (B, T, rotary_dim)
            if self.rope_channels is not None:  # a conversion's frequencies out of the parent's ladder
                cos, sin = cos[..., self.rope_channels], sin[..., self.rope_channels]  # (B, T, rope)
            query_rope, key_rope = apply_rotary(query_rope, key_rope, cos, sin)
        if cache is not None:
            # (B, 1, S, r) and (B, 1, S, rope): every latent and RoPE key so far, this step's included
            latent, key_rope = update_cache(cache, latent, key_rope, self.layer_idx, kwargs)

        if length == 1 and self.absorb_for_decoding and self.up_projection_folds(query_nope.device):
            output, weights = self.attend_absorbed(query_nope, query_rope, latent, key_rope, attention_mask, **kwargs)
        else:
            output, weights = self.attend_expanded(query_nope, query_rope, latent, key_rope, attention_mask, **kwargs)
        return self.o_proj(output.reshape(batch, length, -1)), weights  # (B, T, H, v) -> (B, T, H * v)

    def up_projection_folds(self, device: torch.device) -> bool:
        """Whether `kv_b_proj` is one plain matrix the absorbed path can fold, on the device the step runs on: not a
        wrapped layer (a LoRA adapter), not a quantised tensor (torchao's int8 weights have no `view`), and not a
        weight that offloading keeps elsewhere (accelerate's hooks put an offloaded weight on the execution device
        only around `kv_b_proj`'s own forward; between forwards it is on the meta device, or on the CPU)."""
        if type(self.kv_b_proj) is not nn.Linear:
            return False
        weight = self.kv_b_proj.weight
        return type(weight) in (nn.Parameter, torch.Tensor) and weight.device == device

    def attend_expanded(self, query_nope, query_rope, latent, key_rope, attention_mask, **kwargs):
        """Up-project the latents into per-head keys and values and attend through the backend: `(B, T, H, v)`."""
        batch, _, keys, _ = latent.shape
        # (B, 1, S, r) -> (B, 1, S, H * (nope + v)) -> (B, S, H, nope + v) -> (B, H, S, nope + v)
        expanded = self.kv_b_proj(latent).view(batch, keys, self.num_heads, -1).transpose(1, 2)
        key_nope, value = expanded.split((self.nope_dim, self.v_dim), dim=-1)
        key = torch.cat((key_nope, key_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)  # (B, H, S, nope + rope)
        query = torch.cat((query_nope, query_rope), dim=-1)  # (B, H, T, nope + rope)
        return backend_attention(self, query, key, value, attention_mask, **kwargs)

    def attend_absorbed(self, query_nope, query_rope, latent, key_rope, attention_mask, **kwargs):
        """One query per row (`T = 1`): attend over the latents directly, the up-projections folded into the query
        and the output. The H heads are the H queries of one key/value head whose keys and values are both the
        cached latents, so the backend reads the cache once rather than once per head; the shared RoPE key's scores
        enter as an additive bias, as ALiBi's do, rather than by concatenating `[c; k_rope]` (a copy of the whole
        cache at every step, measured twice the attention's time at 2,048 tokens): `(B, 1, H, v)`."""
        # kv_b_proj.weight (H * (nope + v), r) -> (H, nope + v, r): head h's key and value up-projections
        up = self.kv_b_proj.weight.view(self.num_heads, -1, self.latent_dim)
        up_key, up_value = up.split((self.nope_dim, self.v_dim), dim=1)  # (H, nope, r), (H, v, r)
        # (B, H, 1, nope) @ (H, nope, r) -> (B, H, 1, r) -> (B, 1, H, r): the heads as the queries of one head
        query_latent = torch.matmul(query_nope, up_key).transpose(1, 2)
        # (B, 1, H, rope) @ (B, 1, rope, S) -> (B, 1, H, S), scaled as the backend scales the latent's scores
        bias = torch.matmul(query_rope.transpose(1, 2), key_rope.transpose(-1, -2)) * self.scaling
        if attention_mask is not None:  # (B, 1 or H, 1, S) -> (B, 1, 1 or H, S): one mask row per head-query
            mask = attention_mask.transpose(1, 2)
            bias = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else bias + mask
        output, weights = backend_attention(
            self,
            query_latent,
            latent,
            latent,
            bias,
            **{**kwargs, "is_causal": False},  # H queries of one step: each sees every key, none is "later"
        )  # (B, H, 1, r): the head-queries come back on the sequence axis
        output = torch.matmul(output, up_value.transpose(1, 2))  # (B, H, 1, r) @ (H, r, v) -> (B, H, 1, v)
        weights = weights.transpose(1, 2) if weights is not None else None  # (B, 1, H, S) -> (B, H, 1, S)
        return output.transpose(1, 2), weights  # (B, 1, H, v)


class ZooMLAModel(ZooModel):
    config_class = ZooMLAConfig
    attention_class = ZooMultiHeadLatentAttention


ZooMLAForCausalLM, ZooMLAForSequenceClassification, ZooMLAForTokenClassification, ZooMLAForQuestionAnswering = (
    variant_heads(ZooMLAModel)
)
ZooMLAEncoder, ZooMLADecoder, ZooMLASeq2SeqModel, ZooMLAForConditionalGeneration = seq2seq_classes(ZooMLAModel)
