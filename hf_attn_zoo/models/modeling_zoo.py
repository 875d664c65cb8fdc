"""The decoder backbone every zoo variant shares, written once.

A variant contributes one thing: its attention module (a `ZooAttention` subclass), set as `attention_class` on its
`ZooModel` subclass. Everything else lives here: token and position embeddings, pre-norm decoder layers (RMSNorm or
LayerNorm, gated or plain MLP, residual dropout), the final norm, the LM head, weight initialisation, the causal mask
and the cache. The module layout and parameter names are Llama's (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, `lm_head`), so a Llama state dict loads
unchanged into the MHA family.

Positions (`config.position_embedding_type`) are a backbone choice:
- `rope`: rotary embeddings, computed here from `position_ids` and applied by the attention to queries and keys.
- `alibi`: a per-head linear bias on the attention scores, folded into the additive attention mask built here.
- `sinusoidal` / `learned`: absolute embeddings of `position_ids` added to the token embeddings.
- `none`: nothing; the causal mask alone carries order.
ALiBi, absolute positions and kernels that index parameters by position (Linformer, AFT) read the true positions
from `position_ids`. When a 2D `attention_mask` is given without `position_ids`, positions are counted over the
unmasked tokens, so a left-padded row sees the same positions as the row alone (RoPE alone is relative, so it keeps
Llama's plain `arange`).

This module is copied next to every saved checkpoint, so it only imports transformers, torch and flat siblings.
"""

import functools
import inspect
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_zoo import ZooConfig

__all__ = [
    "BlockwiseCausalMask",
    "CheckpointMismatchError",
    "TokenMask",
    "weighted_values",
    "ZooAttention",
    "ZooDecoderLayer",
    "ZooForCausalLM",
    "ZooForQuestionAnswering",
    "ZooForSequenceClassification",
    "ZooForTokenClassification",
    "ZooHead",
    "ZooMLP",
    "ZooModel",
    "ZooPreTrainedModel",
    "ZooRMSNorm",
    "ZooSoftmaxKernels",
    "ZooRotaryEmbedding",
    "alibi_slopes",
    "apply_rotary",
]


class ZooRMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as Llama's, on torch's fused kernel."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def make_norm(config: ZooConfig) -> nn.Module:
    if config.norm_type == "layernorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    return ZooRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ZooMLP(nn.Module):
    """Position-wise feed-forward: gated `down(act(gate(x)) * up(x))` (Llama's SwiGLU) or plain `down(act(up(x)))`."""

    # Every module of the model names the config fields that size its direct children's tensors, so that a
    # checkpoint that does not fit its config is reported with the fields to fix (see `sizing_fields`).
    sized_by: ClassVar[dict[str, str]] = {
        "gate_proj": "intermediate_size, hidden_size",
        "up_proj": "intermediate_size, hidden_size",
        "down_proj": "intermediate_size, hidden_size",
    }

    def __init__(self, config: ZooConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias) if config.mlp_type == "gated" else None
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ZooAttention(nn.Module):
    """Base of every variant's token mixer.

    Contract: `forward(hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs)` maps
    `(B, T, hidden_size)` to `(output (B, T, hidden_size), attention weights (B, H, T, S) or None)`. It writes its
    cache with `past_key_values.update(..., self.layer_idx)` (or a state layer of its own) and ends with `o_proj`,
    the projection back into the residual stream (GPT-2's scaled init applies to it). `position_embeddings` is the
    RoPE `(cos, signed_sin)` pair for `apply_rotary` when `position_embedding_type == "rope"`, else None; ALiBi
    arrives inside `attention_mask` as an additive float bias; `position_ids` (true positions) come in `kwargs`.
    """

    o_proj: nn.Linear
    sized_by: ClassVar[dict[str, str]] = {}  # the variant's tensors and the config fields that size them
    # What the backbone builds for `attention_mask`:
    # "dense": transformers' causal mask for the backend (4D; ALiBi folded in as an additive float mask);
    # "blockwise": a `BlockwiseCausalMask`, materialised a block of query rows at a time by chunked kernels;
    # "tokens": a `TokenMask` (which new tokens are real, which document of a packed row each belongs to), for
    #   variants that keep sums or states instead of scores.
    # Each of them keeps the documents of a packed row apart, as transformers' own masks do.
    mask_type = "dense"
    # True when the kernel indexes parameters by position (Linformer's E, AFT's bias): positions are then always
    # counted over real tokens, as for absolute position embeddings
    reads_positions = False

    def __init__(self, config: ZooConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx


class ZooDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`, each branch with residual dropout."""

    sized_by: ClassVar[dict[str, str]] = {"input_layernorm": "hidden_size", "post_attention_layernorm": "hidden_size"}

    def __init__(self, config: ZooConfig, layer_idx: int, attention_class: type[ZooAttention]) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = attention_class(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = ZooMLP(config)
        self.hidden_dropout = config.hidden_dropout

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = hidden_states + self._dropout(attn_output)
        return hidden_states + self._dropout(self.mlp(self.post_attention_layernorm(hidden_states)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, training=True) if self.training and self.hidden_dropout else x


class ZooRotaryEmbedding(LlamaRotaryEmbedding):
    """Llama's rotary embedding (so every transformers `rope_type` works), returning `(cos, signed_sin)` where
    `signed_sin` carries the sign of `rotate_half` (-sin on the first half of the channels, +sin on the second).
    Computed once per forward and shared by all layers."""

    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().forward(x, position_ids)  # (B, T, d_h) each; both halves hold the same frequencies
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE with transformers' pairing (channel i rotates with channel i + d_h/2) on `(B, heads, T, d_h)`:
    `x * cos + rotate_half(x) * sin`, where `rotate_half(x) * sin == roll(x, d_h/2) * signed_sin`. Three ops per
    tensor instead of Llama's five: half the time of `apply_rotary_pos_emb` on CPU."""
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # broadcast over heads
    half = query.shape[-1] // 2
    query = torch.addcmul(query * cos, query.roll(half, dims=-1), signed_sin)
    key = torch.addcmul(key * cos, key.roll(half, dims=-1), signed_sin)
    return query, key


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al. 2022): the geometric sequence 2^(-8/n), 2^(-16/n), ... for n heads.

    For a head count that is not a power of two, the paper takes the slopes of the closest smaller power of two and
    fills the remaining heads with every other slope of the next power of two.
    """

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two_slopes(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two_slopes(closest) + power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]


def sinusoidal_embedding(position_ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Vaswani et al. (2017) positions: sin on even channels, cos on odd ones. `(B, T)` -> `(B, T, dim)`."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim))
    angles = position_ids[..., None].float() * inv_freq  # (B, T, dim/2)
    # stack -> (B, T, dim/2, 2) -> flatten: channel 2i is sin, 2i+1 is cos of the same frequency
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


def key_positions(query_positions: torch.LongTensor, past_length: int) -> torch.LongTensor:
    """True positions of all visible keys: the `past_length` cached keys continue contiguously before the first
    query, the new keys are the queries themselves. `(B, T)` -> `(B, past_length + T)`."""
    past = query_positions[:, :1] + torch.arange(-past_length, 0, device=query_positions.device)  # (B, P)
    return torch.cat((past, query_positions), dim=-1)


@dataclass
class BlockwiseCausalMask:
    """A causal attention mask (optionally windowed) with key padding and ALiBi, materialised one rectangle of
    (query rows, key columns) at a time, so that kernels which walk over query chunks never hold the (T, S) matrix.

    Query i (0-based among the T new tokens) is key `past_length + i` of the S visible keys.
    """

    key_length: int  # S
    past_length: int  # keys before the first query
    key_padding: torch.Tensor | None = None  # (B, S) bool, True for real tokens; None when nothing is padded
    sliding_window: int | None = None  # keys j with i - window < j <= i only
    alibi_slopes: torch.Tensor | None = None  # (H,)
    query_positions: torch.LongTensor | None = None  # (B, T) true positions, for ALiBi
    key_positions: torch.LongTensor | None = None  # (B, S)
    documents: torch.LongTensor | None = None  # (B, S) document of each key in a packed row; None: one per row

    def allowed(
        self, q_start: int, q_end: int, k_start: int = 0, k_end: int | None = None, fill_empty_rows: bool = True
    ) -> torch.Tensor:
        """Boolean `(B or 1, 1, q_end - q_start, k_end - k_start)`, True where query may attend to key. A row with no
        allowed key (a padding query) allows all of them unless `fill_empty_rows=False`, so that kernels stay
        finite; its output is never used."""
        k_end = self.key_length if k_end is None else k_end
        device = self.key_padding.device if self.key_padding is not None else None
        queries = torch.arange(q_start, q_end, device=device)[:, None] + self.past_length  # (C, 1) key index of query
        keys = torch.arange(k_start, k_end, device=device)[None, :]  # (1, K)
        allowed = keys <= queries
        if self.sliding_window is not None:
            allowed = allowed & (keys > queries - self.sliding_window)
        allowed = allowed[None, None]  # (1, 1, C, K)
        if self.key_padding is not None:
            allowed = allowed & self.key_padding[:, None, None, k_start:k_end]
        if self.documents is not None:  # a packed row: each query sees the keys of its own document only
            query_documents = self.documents[:, self.past_length + q_start : self.past_length + q_end]  # (B, C)
            allowed = allowed & (query_documents[:, None, :, None] == self.documents[:, None, None, k_start:k_end])
        return allowed | ~allowed.any(dim=-1, keepdim=True) if fill_empty_rows else allowed

    def additive(
        self, q_start: int, q_end: int, dtype: torch.dtype, k_start: int = 0, k_end: int | None = None
    ) -> torch.Tensor:
        """Float mask to add to scores: 0 (or the ALiBi bias) where allowed, the dtype's minimum elsewhere.
        `(B or 1, H or 1, C, K)`."""
        allowed = self.allowed(q_start, q_end, k_start, k_end)
        bias = torch.zeros((), dtype=dtype, device=allowed.device)
        if self.alibi_slopes is not None:
            k_end = self.key_length if k_end is None else k_end
            distance = self.query_positions[:, q_start:q_end, None] - self.key_positions[:, None, k_start:k_end]
            bias = (-self.alibi_slopes.view(1, -1, 1, 1) * distance[:, None]).to(dtype)  # (B, H, C, K)
        return torch.where(allowed, bias, torch.finfo(dtype).min)


def weighted_values(
    outputs: list[torch.Tensor], weights: list[torch.Tensor], value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The result of a chunked kernel: `(B, T, H, d)` and the attention weights `(B, H, T, S)` or None.

    Without weights the chunks' outputs `(B, H, C, d)` are joined. With weights (`output_attentions`) the chunks
    gave their weight rows instead, and the output is computed from the joined matrix, so the weights returned are
    the ones the output depends on (their gradients exist, as for transformers' eager attention)."""
    if weights:
        weights = torch.cat(weights, dim=2)  # (B, H, T, S)
        return torch.matmul(weights, value).transpose(1, 2), weights
    return torch.cat(outputs, dim=2).transpose(1, 2), None  # (B, H, T, d) -> (B, T, H, d)


@dataclass
class TokenMask:
    """What a kernel that keeps running sums instead of scores (Linformer, AFT) needs to know about the T new tokens:
    which are real, and where the documents of a packed row start (its sums restart there)."""

    padding: torch.Tensor | None = None  # (B, T) bool, True for real tokens; None when nothing is padded
    documents: torch.LongTensor | None = None  # (B, T) document of each token in a packed row; None: one per row


def packed_documents(
    position_ids: torch.LongTensor, attention_mask: torch.Tensor | None, past_key_values: Cache | None, batch: int
) -> torch.LongTensor | None:
    """The document index of each token of a packed row `(B, T)`, or None when each row holds one sequence.

    transformers' rule (`masking_utils`): with no 2D attention mask and no cache (padding-free training, e.g.
    `DataCollatorWithFlattening`), a row whose `position_ids` restart at 0 holds several documents, which must not
    see each other. Dense masks get this from `create_causal_mask`; the blockwise and token masks get it here.
    """
    if attention_mask is not None or past_key_values is not None:
        return None
    return find_packed_sequence_indices(position_ids.expand(batch, -1))


class ZooPreTrainedModel(PreTrainedModel):
    config: ZooConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ZooDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _can_record_outputs = {"hidden_states": ZooDecoderLayer, "attentions": ZooAttention}
    # Backends a variant can run through `ALL_ATTENTION_FUNCTIONS` (eager always works); variants set their own.
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config: ZooConfig, *inputs, **kwargs) -> None:
        # A config may have been mutated after construction: check it again before building anything.
        config.validate()
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # parameters that are not Linear/Embedding/norm weights (score vectors, Linformer's E and F) init themselves
        if hasattr(module, "init_parameters"):
            module.init_parameters(self.config)
        # GPT-2: the projections writing into the residual stream start smaller, std / sqrt(2L), so the variance of
        # the stream does not grow with depth. Children are initialised before their parent, so this wins.
        if isinstance(module, ZooDecoderLayer) and self.config.scale_residual_init:
            std = self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)
            init.normal_(module.self_attn.o_proj.weight, mean=0.0, std=std)
            init.normal_(module.mlp.down_proj.weight, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, with a clearer error for weights whose shape does not fit the config.

        As in transformers, missing and unexpected tensors are reported (a warning, and `output_loading_info=True`)
        and missing ones are initialised by `_init_weights`: a base-model checkpoint loads into the causal LM. A
        tensor whose shape differs from what the config builds is an error naming the tensor and the config fields
        that size it, unless `ignore_mismatched_sizes=True` (then it is initialised afresh, as transformers does).
        """
        accept_mismatch = kwargs.pop("ignore_mismatched_sizes", False)
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            ignore_mismatched_sizes=True,  # loaded to build the message below; refused unless asked for
            output_loading_info=True,
            **kwargs,
        )
        if info["mismatched_keys"] and not accept_mismatch:
            raise CheckpointMismatchError(
                describe_mismatch(pretrained_model_name_or_path, model, info["mismatched_keys"])
            )
        return (model, info) if return_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        # transformers writes only the saved class into `auto_map`; list the three Auto classes so the checkpoint
        # loads with `trust_remote_code=True` as a config, a base model or a causal LM.
        self.config.auto_map = auto_map_for(type(self))
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", args[0] if args else True):
            _write_model_card(save_directory, self.config)  # a card already in the folder (a trainer's) is kept
        return result

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        # `push_to_hub` overwrites the README.md `save_pretrained` wrote, with the repo's card or, for a repo without
        # one, a generic template (transformers' `create_and_tag_model_card`); this hook sees the folder just before
        # the upload and puts the zoo card in place of that template.
        _write_model_card(working_dir, self.config, repo_id=repo_id, replace_generic=True)
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)


def _write_model_card(folder, config: ZooConfig, **kwargs) -> None:
    """The package's model card (`hf_attn_zoo.cards.write_card`) in `folder`. This module travels with checkpoints
    and may run as remote code where the package is not installed: then nothing is written. (transformers does not
    count imports inside `try` as requirements of remote code.)"""
    try:
        from hf_attn_zoo.cards import write_card
    except ImportError:
        return
    write_card(folder, config, **kwargs)


class CheckpointMismatchError(ValueError, RuntimeError):
    """Weights whose shapes do not fit the config: a `ValueError` (bad input) that is also the `RuntimeError`
    transformers raises for it, so code written against either catches it."""


def sizing_fields(model: nn.Module, key: str) -> str:
    """The config fields that size the tensor `key` of `model`, as declared by the module that owns it: the
    nearest module on the path whose `sized_by` names the next step (`self_attn` names `q_proj`, ...)."""
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        try:
            owner = model.get_submodule(".".join(parts[: depth - 1]))
        except AttributeError:
            continue
        fields = getattr(owner, "sized_by", {}).get(parts[depth - 1])
        if fields:
            return fields
    return "the variant's own fields"


def describe_mismatch(source, model: nn.Module, mismatched: list) -> str:
    config = model.config
    lines = [f"the weights in {source} do not fit the model its config describes ({config.model_type}):"]
    for key, checkpoint_shape, model_shape in sorted(mismatched)[:8]:
        lines.append(
            f"  {key}: checkpoint {list(checkpoint_shape)}, config builds {list(model_shape)} "
            f"(sized by {sizing_fields(model, key)})"
        )
    if len(mismatched) > 8:
        lines.append(f"  ... and {len(mismatched) - 8} more")
    lines.append(
        "Restore the config.json saved with these weights, or pass ignore_mismatched_sizes=True to initialise the "
        "tensors that do not fit afresh."
    )
    return "\n".join(lines)


class ZooSoftmaxKernels:
    """Mixin for variants whose scores go through transformers' `ALL_ATTENTION_FUNCTIONS` unchanged."""

    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # key/value caches written in place and masks of fixed shape: a static-cache decode step compiles to one graph
    _can_compile_fullgraph = True


def auto_map_for(model_class: type[ZooPreTrainedModel]) -> dict[str, str]:
    """`auto_map` naming every class of `model_class`'s variant (config, base model and each head), as
    `<module file>.<class>`, so a checkpoint loads with `trust_remote_code=True` through any of the Auto classes."""
    base = model_class if issubclass(model_class, ZooModel) else model_class.base_model_class

    def name(cls: type) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    auto_map = {"AutoConfig": name(base.config_class), "AutoModel": name(base)}
    return auto_map | {auto_class: name(head) for auto_class, head in base.heads.items()}


def returns_output_to_its_head(forward):
    """A base model inside a head (causal LM, classifier ...) returns its output object whatever
    `config.return_dict` says: the head reads fields off it and applies `return_dict` to its own output. (Native
    transformers models break there: with `config.return_dict = False` Llama's head gets a tuple and fails.)"""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if self.inside_head and kwargs.get("return_dict") is None:
            kwargs["return_dict"] = True
        return forward(self, *args, **kwargs)

    return wrapper


class ZooModel(ZooPreTrainedModel):
    """Embeddings, `num_hidden_layers` decoder layers built around `attention_class`, and the final norm."""

    attention_class: type[ZooAttention]
    causal_lm_class = None  # the variant's ZooForCausalLM subclass, set by `ZooHead.__init_subclass__`
    heads: ClassVar[dict[str, type]] = {}  # auto class name -> this variant's head of that kind (a `ZooHead`)
    inside_head = False  # set on the instance a head builds (see `returns_output_to_its_head`)
    sized_by: ClassVar[dict[str, str]] = {
        "embed_tokens": "vocab_size, hidden_size",
        "embed_positions": "max_position_embeddings, hidden_size",
        "norm": "hidden_size",
    }

    def __init__(self, config: ZooConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        # read once: config attribute access is slow, and the forward runs once per generated token
        self.position_embedding_type = position_type = config.position_embedding_type
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size) if position_type == "learned" else None
        )
        self.rotary_emb = ZooRotaryEmbedding(config=config) if position_type == "rope" else None
        self.layers = nn.ModuleList(
            [ZooDecoderLayer(config, layer_idx, self.attention_class) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config)
        self.gradient_checkpointing = False
        self.share_across_layers()
        self.post_init()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.heads = {}  # each variant lists its own heads

    def share_across_layers(self) -> None:
        """Hook for parameters that all layers share (Linformer's layerwise projection); runs before init."""

    def make_cache(self) -> Cache:
        """The cache `forward` (and `generate`) starts when none is given: key/value layers (sliding-window ones when
        the config has `sliding_window`); variants that decode from a state return a `ZooStateCache`."""
        return DynamicCache(config=self.config)

    @returns_output_to_its_head
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if use_cache and past_key_values is None:
            past_key_values = self.make_cache()
        if position_ids is None:
            position_ids = self._default_position_ids(inputs_embeds, attention_mask, past_key_values)

        hidden_states = inputs_embeds
        position_type = self.position_embedding_type
        if position_type == "learned":
            self._check_learned_positions(position_ids)
            hidden_states = hidden_states + self.embed_positions(position_ids)
        elif position_type == "sinusoidal":
            hidden_states = hidden_states + sinusoidal_embedding(
                position_ids, self.config.hidden_size, hidden_states.dtype
            )
        if self.training and self.config.hidden_dropout:
            hidden_states = F.dropout(hidden_states, self.config.hidden_dropout, training=True)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None

        # a flag left at None falls back to the config, as in transformers; kernels read the resolved value
        if kwargs.get("output_attentions") is None:
            kwargs["output_attentions"] = self.config.output_attentions
        causal_mask = self._attention_mask(
            inputs_embeds, attention_mask, past_key_values, position_ids, kwargs["output_attentions"]
        )

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)

    def _default_position_ids(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values: Cache | None
    ) -> torch.LongTensor:
        seq_length = inputs_embeds.shape[1]
        absolute = self.position_embedding_type in ("alibi", "sinusoidal", "learned")
        if (
            (absolute or self.attention_class.reads_positions)
            and attention_mask is not None
            and attention_mask.ndim == 2
        ):
            # Count real tokens only: a left-padded row gets the positions it would have alone; pads sit at 0.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, past + T)
            return position_ids[:, -seq_length:]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        return torch.arange(past_length, past_length + seq_length, device=inputs_embeds.device).unsqueeze(0)

    def _check_learned_positions(self, position_ids: torch.LongTensor) -> None:
        if torch.compiler.is_compiling():
            return
        longest = int(position_ids.max())
        if longest >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {longest} is beyond max_position_embeddings={self.config.max_position_embeddings} of the "
                f"learned position table; shorten the input or build the model with a larger max_position_embeddings."
            )

    def _attention_mask(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None,
        position_ids: torch.LongTensor,
        output_attentions: bool = False,
    ) -> torch.Tensor | BlockwiseCausalMask | TokenMask | None:
        """What the attention modules get as `attention_mask`, by the variant's `mask_type` (see `ZooAttention`)."""
        mask_type = self._mask_type(inputs_embeds.shape[1], output_attentions)
        if mask_type == "dense":
            return self._dense_mask(inputs_embeds, attention_mask, past_key_values, position_ids)
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(
                f"{self.config.model_type} builds its own causal mask and takes a 2D padding mask (batch, length), "
                f"got a {attention_mask.ndim}D attention_mask; pass the padding mask instead."
            )
        documents = packed_documents(position_ids, attention_mask, past_key_values, inputs_embeds.shape[0])
        if mask_type == "blockwise":
            return self._blockwise_mask(inputs_embeds, attention_mask, past_key_values, position_ids, documents)
        padding = None
        if attention_mask is not None and not bool(attention_mask.all()):
            padding = attention_mask[:, -inputs_embeds.shape[1] :].bool()  # (B, T): the new tokens
        return TokenMask(padding=padding, documents=documents)

    def _mask_type(self, query_length: int, output_attentions: bool) -> str:
        return self.attention_class.mask_type

    # transformers' mask builder for the dense path; the sliding-window variant uses the windowed one
    create_dense_mask = staticmethod(create_causal_mask)

    def _dense_mask(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None,
        position_ids: torch.LongTensor,
    ) -> torch.Tensor | None:
        """The causal and padding mask for the chosen backend; with ALiBi, an additive float mask with the bias."""
        alibi = self.position_embedding_type == "alibi"
        if alibi and self.config._attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"position_embedding_type='alibi' adds a bias to every attention score, which the "
                f"{self.config._attn_implementation!r} backend cannot take; load the model with "
                f"attn_implementation='sdpa' or 'eager', or use position_embedding_type='rope'."
            )
        mask = self.create_dense_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
            allow_is_causal_skip=not alibi,  # ALiBi needs the mask materialised to carry its bias
        )
        if not alibi:
            return mask
        batch_size, key_length = mask.shape[0], mask.shape[-1]
        query_positions = position_ids.expand(batch_size, -1)  # (B, T)
        keys = key_positions(query_positions, key_length - query_positions.shape[1])  # (B, S)
        distance = query_positions[:, None, :, None] - keys[:, None, None, :]  # (B, 1, T, S)
        bias = -self._alibi_slopes(mask.device).view(1, -1, 1, 1) * distance  # (B, H, T, S)
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return torch.where(allowed, bias, torch.finfo(inputs_embeds.dtype).min).to(inputs_embeds.dtype)

    def _blockwise_mask(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None,
        position_ids: torch.LongTensor,
        documents: torch.LongTensor | None = None,
    ) -> BlockwiseCausalMask:
        batch_size, query_length = inputs_embeds.shape[:2]
        key_length, past_length = query_length, 0
        if past_key_values is not None:
            key_length, _ = past_key_values.get_mask_sizes(query_length, 0)
            # The queries follow the cached tokens. A rolling (sliding) cache holds only the last of them; a static
            # cache is longer than what it holds, and its slots after the queries are empty (causality hides them).
            past_length = min(int(past_key_values.get_seq_length()), key_length - query_length)
        key_padding = None
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
            seen = attention_mask.shape[1] - query_length  # tokens before the queries, cached or not
            key_padding = attention_mask[:, seen - past_length :].bool()  # (B, past_length + T): the keys held
            key_padding = F.pad(key_padding, (0, key_length - key_padding.shape[1]), value=False)  # (B, S)
        mask = BlockwiseCausalMask(
            key_length=key_length,
            past_length=past_length,
            key_padding=key_padding,
            sliding_window=getattr(self.config, "sliding_window", None),
            documents=documents,  # packed rows have no cache: the keys are the queries
        )
        if self.position_embedding_type == "alibi":
            mask.alibi_slopes = self._alibi_slopes(inputs_embeds.device)
            mask.query_positions = position_ids.expand(batch_size, -1)
            mask.key_positions = key_positions(mask.query_positions, mask.past_length)
        return mask

    def _alibi_slopes(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(alibi_slopes(self.config.num_attention_heads), device=device, dtype=torch.float32)


class LinearCrossEntropy(torch.autograd.Function):
    """`cross_entropy(hidden @ weight.T, targets)` summed over valid targets and divided by `divisor`, without ever
    holding the `(N, vocab)` logits: tokens go through in chunks, and each chunk's gradients (softmax minus one-hot,
    pushed through the head at once) are computed in the forward pass, then scaled in the backward (the approach of
    Liger's fused linear cross-entropy). Same three matmuls as the plain path, a fraction of the memory traffic.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, ignore_index: int, chunk_size: int):
        # hidden (N, d), weight (V, d), targets (N,)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # bf16/fp16 logits upcast, as transformers does
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = hidden[start : start + chunk_size]  # (n, d)
            target = targets[start : start + chunk_size]  # (n,)
            logits = (chunk @ weight.T).to(loss_dtype)  # (n, V)
            valid = target != ignore_index
            safe_target = torch.where(valid, target, 0)
            log_normaliser = torch.logsumexp(logits, dim=-1)  # (n,)
            target_logit = logits.gather(1, safe_target[:, None]).squeeze(1)
            total += ((log_normaliser - target_logit) * valid).sum()
            # d(sum of losses)/d(logits) = softmax - one_hot(target) on valid rows; computed in the logits' buffer
            grad_logits = logits.sub_(log_normaliser[:, None]).exp_().mul_(valid[:, None])
            grad_logits.scatter_add_(1, safe_target[:, None], -valid[:, None].to(grad_logits.dtype))
            grad_logits = grad_logits.to(hidden.dtype)
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_size])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, chunk)
        ctx.save_for_backward(grad_hidden, grad_weight, divisor)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, divisor = ctx.saved_tensors
        scale = (grad_output / divisor).to(grad_hidden.dtype)
        return grad_hidden * scale, None if grad_weight is None else grad_weight * scale, None, None, None, None


def causal_lm_loss_fused(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.LongTensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.LongTensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` (shifted labels, mean over valid tokens or sum / `num_items_in_batch`), computed
    by `LinearCrossEntropy`."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # token t predicts token t + 1
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (B, T, d) -> (B*T, d)
    divisor = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    divisor = torch.as_tensor(divisor, device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
    if chunk_size is None:  # about 8 MiB of fp32 logits per chunk on CPU (cache-sized), 1 GiB on accelerators
        budget = 1 << (21 if hidden.device.type == "cpu" else 28)
        chunk_size = max(1, budget // lm_head.out_features)
    return LinearCrossEntropy.apply(hidden, lm_head.weight, targets, divisor, ignore_index, chunk_size)


class ZooHead(ZooPreTrainedModel):
    """A variant's base model (`self.model`) under a head. A variant's head class sets `base_model_class`; that
    makes it the variant's head for `auto_class` (listed in `base_model_class.heads`, so in a checkpoint's
    `auto_map`), takes the base model's config class and registers it for `trust_remote_code` saving."""

    auto_class: ClassVar[str]
    base_model_class: type[ZooModel]
    # what transformers reads off the top-level class to pick a backend: the base model's answers
    BACKEND_FLAGS = (
        "_supports_sdpa",
        "_supports_flash_attn",
        "_supports_flex_attn",
        "_supports_attention_backend",
        "_can_compile_fullgraph",
    )

    def __init_subclass__(cls, **kwargs) -> None:
        base = cls.__dict__.get("base_model_class")
        if base is not None:
            cls.config_class = base.config_class
            for flag in cls.BACKEND_FLAGS:
                setattr(cls, flag, getattr(base, flag))
        super().__init_subclass__(**kwargs)
        if base is not None:
            base.heads[cls.auto_class] = cls
            cls.register_for_auto_class(cls.auto_class)

    def _build_base_model(self, config: ZooConfig) -> None:
        """`self.model`, built directly: transformers' generic heads go through `AutoModel.from_config`, which does
        not know the variant when the checkpoint is loaded as remote code."""
        ZooPreTrainedModel.__init__(self, config)
        self.model = self.base_model_class(config)
        self.model.inside_head = True


class ZooForSequenceClassification(GenericForSequenceClassification, ZooHead):
    """transformers' sequence classifier over the variant: the head reads the last non-padding token (the one that
    has seen the whole sequence in a causal model); `config.num_labels` classes, `config.problem_type` losses."""

    auto_class = "AutoModelForSequenceClassification"
    sized_by: ClassVar[dict[str, str]] = {"score": "num_labels, hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.num_labels = config.num_labels
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()


class ZooForTokenClassification(GenericForTokenClassification, ZooHead):
    """transformers' token classifier over the variant (dropout `hidden_dropout`, then a linear layer per token)."""

    auto_class = "AutoModelForTokenClassification"
    sized_by: ClassVar[dict[str, str]] = {"score": "num_labels, hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.num_labels = config.num_labels
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class ZooForQuestionAnswering(GenericForQuestionAnswering, ZooHead):
    """transformers' extractive question answering head over the variant: start and end logits per token."""

    auto_class = "AutoModelForQuestionAnswering"
    sized_by: ClassVar[dict[str, str]] = {"qa_outputs": "hidden_size"}

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


class ZooForCausalLM(ZooHead, GenerationMixin):
    """A `ZooModel` with a language-modelling head; each variant subclasses it and sets `base_model_class`."""

    auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    sized_by: ClassVar[dict[str, str]] = {"lm_head": "vocab_size, hidden_size"}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        base = cls.__dict__.get("base_model_class")
        if base is not None:
            base.causal_lm_class = cls

    def __init__(self, config: ZooConfig) -> None:
        self._build_base_model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate` builds a cache of key/value layers; a variant that decodes from a state puts its own in place,
        and refuses cache implementations (static, quantized, offloaded) that presuppose keys and values."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if type(self.model).make_cache is ZooModel.make_cache:
            return
        cache = model_kwargs.get("past_key_values")
        if cache is None or getattr(cache, "_is_user_defined", False):
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"{self.config.model_type} decodes from a state per layer, not from keys and values: "
                f"cache_implementation={generation_config.cache_implementation!r} does not apply; leave it unset."
            )
        model_kwargs["past_key_values"] = self.model.make_cache()

    def create_masks_for_generate(
        self,
        config: ZooConfig,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> torch.Tensor | None:
        """With a static cache `generate` builds the 4D mask outside the model, so that a compiled decode step sees
        fixed shapes. That suits the dense path (ALiBi's bias is added to it in `forward`); kernels that walk over
        blocks build their mask from the 2D padding mask, so for them it stays 2D."""
        if self.model._mask_type(inputs_embeds.shape[1], False) != "dense":
            return attention_mask
        return self.model.create_dense_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )

    def _fuse_loss(self, logits_to_keep: int | torch.Tensor) -> bool:
        """Whether training can skip the logits: only a plain `nn.Linear` head (not one wrapped by PEFT or a
        quantizer) over every position, with gradients on."""
        return (
            self.config.fuse_linear_cross_entropy
            and self.training
            and torch.is_grad_enabled()
            and type(self.lm_head) is nn.Linear
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
        )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,  # consumed by @can_return_tuple: False returns a tuple
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets for the next-token loss; they are shifted inside, and -100 is ignored. In training mode (with
            gradients, `config.fuse_linear_cross_entropy` on) the head and the loss run fused and `logits` is None.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute logits for the last `logits_to_keep` positions only (0 keeps all), or for the given indices.
        """
        for name, flag in (("output_attentions", output_attentions), ("output_hidden_states", output_hidden_states)):
            if flag is not None:
                kwargs[name] = flag
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = loss = None
        if labels is not None and self._fuse_loss(logits_to_keep):
            loss = causal_lm_loss_fused(
                hidden_states,
                self.lm_head,
                labels,
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                shift_labels=kwargs.get("shift_labels"),
            )
        else:
            logits = self.lm_head(hidden_states)  # (B, T_kept, vocab)
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# Classes registered with `register_for_auto_class` count as remote code, for which `generate` runs
# `inspect.signature(self.forward)` at every decoding step (looking for a legacy `cache_position` argument). A
# precomputed signature turns that lookup into an attribute read: 3-4% of batch-1 decoding time on CPU.
ZooForCausalLM.forward.__signature__ = inspect.signature(ZooForCausalLM.forward)
