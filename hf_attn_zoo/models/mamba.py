"""Mamba: a selective state-space mixer in place of attention, and blocks without an MLP.

Paper: Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces" (Mamba-1, Algorithm 2 and
section 3.4's block). What differs from attention: each layer mixes tokens through a recurrence with a fixed-size
state instead of scores over earlier tokens. Per layer, with D = `intermediate_size` channels and N = `state_size`
states per channel:

    x, z = in_proj(u)                        (D each; z is the gate)
    x = act(causal_conv1d(x))                depthwise over the last `conv_kernel` tokens
    Δ = softplus(dt_proj(x W_Δ)), B = x W_B, C = x W_C     input-dependent (the "selection"): rank R, N, N from x_proj
    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t  (D x N per token; A = -exp(A_log), fixed per channel and state)
    y_t = C_t h_t + D ⊙ x_t,   out = out_proj(y ⊙ silu(z))

Mamba blocks are `x + mixer(norm(x))` with no MLP: a model of this variant has `mlp_type="none"` (the backbone's
optional MLP), so its layers are the paper's blocks and a transformers `MambaForCausalLM` maps onto it tensor for
tensor (`hf_attn_zoo.convert.mamba`). Parameter names inside the mixer are transformers' `MambaMixer`'s (`in_proj`,
`conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`); `intermediate_size` is the mixer's width D, as in
`MambaConfig` (expand · hidden_size, 2 · hidden_size unless set).

Training, scoring and a prompt: `selective_scan` computes the decays exp(Δ_t A) and inputs Δ_t B_t x_t of
`scan_chunk_size` tokens at once, then steps the recurrence through them one token at a time, one fused
multiply-add over the (D, N) state per token: O(T·D·N) time, as the paper's scan, in torch on any device. An
earlier form summed each chunk in closed form (every pair of tokens in it, O(T·D·N·c)); on CPUs it was 3 times
slower at chunks of 4 and its time grew with the chunk, so it now serves only graphs being exported
(`closed_form_scan`, the whole row as one chunk), where a loop over a dynamic length cannot be traced.

Cache: decoding keeps, per layer, the last `conv_kernel - 1` inputs of the convolution (D·(k - 1)) and the state h
(D·N), whatever the length (`ZooStateLayer`, keys "conv" and "ssm"); beam search reorders it, and it cannot be
cropped (assisted decoding is refused by the state layer).

Packed rows (`position_ids` restarting at 0 without a padding mask): the convolution reads only its own document's
inputs and the state restarts at each document's first token. Padding contributes nothing: its inputs are zeroed
before the convolution and its Δ is 0, so the state passes a padding token unchanged (left padding: it stays 0).

Positions: none. The convolution and the recurrence see the order; `position_embedding_type` is "none" only (adding
absolute positions is not the paper's model). No encoder form: the scan is causal by construction and Mamba-1
defines no bidirectional one, so this variant has no encoder-decoder classes and its config refuses
`is_encoder_decoder=True` and `is_decoder=False`. `output_attentions` gives None (there
are no attention weights). Deviation from the paper: none beyond the backbone's final norm and tied embeddings, both
as transformers' `MambaForCausalLM`; the fused CUDA kernels are not used (the scan is plain torch).
"""

import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN

from .cache_zoo import ZooStateLayer, state_layer
from .configuration_zoo import BACKBONE_SIZES, ZooConfig, check_positive_int
from .heads_zoo import variant_heads
from .layers_zoo import ZooAttention
from .masks_zoo import TokenMask
from .modeling_zoo import ZooModel

MAMBA_REFUSAL = (
    "{model_type} has no bidirectional form: Mamba-1's selective scan is causal by construction (each state folds in "
    "the tokens before it) and the paper defines no non-causal one, so it cannot be an encoder ({field}); use it as "
    "a decoder-only language model, or choose a variant with a bidirectional form (mha, gqa, linear ...) for the "
    "encoder."
)


class ZooMambaConfig(ZooConfig):
    """Mamba's fields, named as transformers' `MambaConfig` names them:

    Args:
        state_size (`int`): N, states per channel (16 in the paper).
        conv_kernel (`int`): width of the depthwise causal convolution (4).
        time_step_rank (`int`, *optional*): R, rank of Δ's projection; default ceil(hidden_size / 16).
        intermediate_size (`int`, *optional*): D, the mixer's width; default 2 · hidden_size (the paper's expand=2).
        use_bias (`bool`): bias on `in_proj` and `out_proj`; use_conv_bias (`bool`): bias on the convolution.
        time_step_min, time_step_max, time_step_floor, time_step_scale (`float`): the initial Δ, log-uniform in
            [min, max] and at least floor, and the scale of `dt_proj`'s initial weights (the paper's init).
        scan_chunk_size (`int`): tokens whose decays and inputs the scan computes at once (memory O(D·N·c) per
            row); the recurrence steps through them one at a time, so the result does not depend on it.
    """

    model_type = "zoo_mamba"
    paper = 'Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"'
    arxiv = ("2312.00752",)
    # no heads: the presets name none, so the head fields keep the class's one head (unused by the mixer), and tools
    # that scale heads (the quality board) leave them alone. Twice the layers of the attention presets, as the paper
    # sizes Mamba against Transformers (a block of ~6·d² parameters where a Transformer layer has ~12·d²): base is
    # Mamba-130M's shape (24 layers of 768)
    presets: ClassVar[dict[str, dict]] = {
        size: {
            **{k: v for k, v in backbone.items() if k not in ("intermediate_size", "num_attention_heads")},
            "num_hidden_layers": layers,
        }
        for (size, backbone), layers in zip(BACKBONE_SIZES.items(), (2, 12, 24))
    }
    description = "selective state space (Gu & Dao 2023): input-dependent Δ, B, C, causal conv, a scan; no MLP"
    cache_per_token = "0 (state: L·D·(N + conv_kernel - 1))"
    supported_position_types = ("none",)

    position_embedding_type: str = "none"
    num_attention_heads: int = 1
    mlp_type: str = "none"
    rms_norm_eps: float = 1e-5
    state_size: int = 16
    conv_kernel: int = 4
    time_step_rank: int | None = None
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_scale: float = 1.0
    scan_chunk_size: int = 64

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None and isinstance(self.hidden_size, int):
            self.intermediate_size = 2 * self.hidden_size  # the paper's expand = 2
        if self.time_step_rank is None and isinstance(self.hidden_size, int):
            self.time_step_rank = math.ceil(self.hidden_size / 16)  # MambaConfig's "auto"
        super().__post_init__(**kwargs)

    def _check_variant(self) -> None:
        for field, meaning in (
            ("state_size", "N, the states per channel of the scan"),
            ("conv_kernel", "the width of the causal convolution"),
            ("time_step_rank", "the rank of Δ's projection"),
            ("scan_chunk_size", "tokens per chunk of the scan"),
        ):
            check_positive_int(self, field, meaning)
        if self.mlp_type != "none":
            raise ValueError(
                f"mlp_type={self.mlp_type!r}: Mamba blocks have no MLP (the mixer's gate and expansion take its "
                f"place), so {self.model_type} needs mlp_type='none'; its width is intermediate_size, the mixer's."
            )
        if not 0 < self.time_step_min <= self.time_step_max:
            raise ValueError(
                f"time_step_min={self.time_step_min} and time_step_max={self.time_step_max}: the initial Δ is drawn "
                f"log-uniformly between them, so 0 < time_step_min <= time_step_max."
            )
        if self.is_encoder_decoder or (not self.is_decoder and not self.add_cross_attention):
            field = "is_encoder_decoder=True" if self.is_encoder_decoder else "is_decoder=False"
            raise ValueError(MAMBA_REFUSAL.format(model_type=self.model_type, field=field))


def causal_conv(conv: nn.Conv1d, x: torch.Tensor, past: torch.Tensor, documents=None) -> torch.Tensor:
    """The depthwise causal convolution `conv` (no padding of its own) of `x` `(B, D, T)` after the `past` `(B, D,
    k - 1)` inputs -> `(B, D, T)`. With `documents` `(B, T)` (a packed row, `past` zeros) a token reads only inputs of
    its own document. The weights are read through `conv`'s own forward, so offloading hooks (accelerate) see them."""
    full = torch.cat((past, x), dim=-1)  # (B, D, k - 1 + T)
    if documents is None:
        return conv(full)
    batch, width, length = x.shape
    kernel = conv.kernel_size[0]
    # the document of every window entry; the k - 1 entries before the row belong to none (-1)
    padded = F.pad(documents, (kernel - 1, 0), value=-1)  # (B, k - 1 + T)
    same = padded.unfold(-1, kernel, 1) == documents[..., None]  # (B, T, k)
    windows = full.unfold(-1, kernel, 1) * same[:, None].to(x.dtype)  # (B, D, T, k): token t's window, its document's
    # each window convolved alone: (B, D, T, k) -> (B, T, D, k) -> (B·T, D, k) -> (B·T, D, 1) -> (B, T, D) -> (B, D, T)
    windows = windows.permute(0, 2, 1, 3).reshape(batch * length, width, kernel)
    return conv(windows).view(batch, length, width).transpose(1, 2)


def selective_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int,
    documents: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t, y_t = C_t h_t (module docstring). `x`, `delta` `(Bt, D, T)`, `A`
    `(D, N)` (negative), `B`, `C` `(Bt, T, N)`, `state` `(Bt, D, N)` before the first token (None: zeros). Returns y
    `(Bt, D, T)` (without the D skip) and the state after the last token. With `documents` `(Bt, T)` (a packed row,
    no state), the state restarts at each document's first token.

    The decays and inputs of `chunk` tokens are computed at once, then the recurrence steps through them one token
    at a time (one fused multiply-add over `(Bt, D, N)` per token). While exporting, where a graph cannot loop over a
    dynamic length, `closed_form_scan` computes every token at once instead."""
    batch, width, length = x.shape
    if state is None:
        state = x.new_zeros(batch, width, A.shape[-1])
    if torch.compiler.is_exporting():
        return closed_form_scan(x, delta, A, B, C, state, documents)
    # token-major from here on: each chunk's decays and inputs are then made contiguous by the op that computes them,
    # each step reads one contiguous (Bt, D, N) block of them, and no chunk is permuted and copied
    delta_t = delta.permute(2, 0, 1)  # (Bt, D, T) -> (T, Bt, D)
    scaled_x = (delta * x).permute(2, 0, 1)  # (T, Bt, D): Δ_t x_t
    B_t, C_t = B.transpose(0, 1), C.transpose(0, 1)  # (Bt, T, N) -> (T, Bt, N)
    if documents is not None:  # a document's first token decays the state before it to nothing
        first = torch.ones_like(documents, dtype=torch.bool)
        first[:, 1:] = documents[:, 1:] != documents[:, :-1]  # (Bt, T)
        first = first.t()[:, :, None, None]  # (T, Bt, 1, 1)
    outputs = []
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        decays = torch.exp(delta_t[start:end, :, :, None] * A)  # (c, Bt, D, N): exp(Δ_t A), every exponent <= 0
        if documents is not None:
            decays = decays.masked_fill(first[start:end], 0.0)
        inputs = scaled_x[start:end, :, :, None] * B_t[start:end, :, None, :]  # (c, Bt, D, N): Δ_t B_t x_t
        states = []
        # one unbind of each: the backward of one unbind stacks the gradients once, where c index selects would each
        # fill a zero tensor of the whole chunk (measured: 73% of a training step)
        for step_input, decay in zip(inputs.unbind(0), decays.unbind(0)):
            state = torch.addcmul(step_input, decay, state)  # (Bt, D, N)
            states.append(state)
        outputs.append(torch.einsum("cbdn,cbn->cbd", torch.stack(states), C_t[start:end]))  # (c, Bt, D): C_t h_t
    return torch.cat(outputs).permute(1, 2, 0), state  # (T, Bt, D) -> (Bt, D, T)


def closed_form_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    documents: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`selective_scan` without a loop, for graphs being exported: h_t = Σ_{s≤t} exp(Σ_{s<r≤t} Δ_r A) Δ_s B_s x_s
    plus the state before the first token decayed to t (the decays from one cumulative sum, every exponent <= 0, so
    nothing overflows). O(T²·D·N) time and memory: for export, not for training."""
    length = x.shape[-1]
    log_decay = (delta[..., None] * A[None, :, None, :]).cumsum(2)  # (Bt, D, T, N): Σ_{r<=t} Δ_r A
    inputs = delta[..., None] * B[:, None] * x[..., None]  # (Bt, D, T, N): Δ_s B_s x_s
    within = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()  # (T, T): s <= t
    carried = torch.exp(log_decay) * state[:, :, None]  # (Bt, D, T, N): the state before the row, decayed
    if documents is not None:
        within = within & (documents[:, :, None] == documents[:, None, :])  # (Bt, T, T)
        carried = carried * (documents == documents[:, :1])[:, None, :, None]  # (Bt, 1, T, 1)
        within = within[:, None, :, :, None]  # (Bt, 1, T, T, 1)
    else:
        within = within[None, None, :, :, None]  # (1, 1, T, T, 1)
    gaps = log_decay[:, :, :, None] - log_decay[:, :, None]  # (Bt, D, T, T, N): L_t - L_s
    states = (torch.exp(gaps.masked_fill(~within, float("-inf"))) * inputs[:, :, None]).sum(3) + carried
    return (states * C[:, None]).sum(-1), states[:, :, -1]  # (Bt, D, T), (Bt, D, N)


class ZooMambaMixer(ZooAttention):
    """Mamba-1's mixer (transformers' `MambaMixer` names): `in_proj` to x and the gate z, the depthwise causal
    `conv1d`, `x_proj` to (Δ's low-rank input, B, C), `dt_proj` to Δ, the scan over `A_log` and `D`, `out_proj`."""

    family = "mamba"
    native_format = "mamba"  # transformers' MambaForCausalLM (`hf_attn_zoo.convert.mamba`)
    gguf_architecture = "mamba"  # llama.cpp's Mamba-1 (`hf_attn_zoo.convert.gguf_writer`)
    backends = ("eager",)  # its own kernel
    compiles_fullgraph = False
    cache_layer = ZooStateLayer  # {"conv": (B, D, k - 1), "ssm": (B, D, N)}: nothing grows with the length
    mask_type = "tokens"
    caches = "a convolution window and a state of N values per channel"
    lora_targets: ClassVar[tuple[str, ...]] = ("in_proj", "x_proj", "dt_proj", "out_proj")
    parent_weights: ClassVar[tuple[str, ...] | None] = ()  # no projection of an attention means anything here
    parent_head_fields: ClassVar[tuple[str, ...]] = ()
    sized_by: ClassVar[dict[str, str]] = {
        "in_proj": "intermediate_size, hidden_size",
        "conv1d": "intermediate_size, conv_kernel",
        "x_proj": "time_step_rank, state_size, intermediate_size",
        "dt_proj": "time_step_rank, intermediate_size",
        "A_log": "intermediate_size, state_size",
        "D": "intermediate_size",
        "out_proj": "intermediate_size, hidden_size",
    }

    def __init__(self, config: ZooMambaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        hidden, width, states = config.hidden_size, config.intermediate_size, config.state_size
        self.intermediate_size, self.ssm_state_size = width, states
        self.conv_kernel_size, self.time_step_rank = config.conv_kernel, config.time_step_rank
        self.is_causal = True
        self.in_proj = nn.Linear(hidden, 2 * width, bias=config.use_bias)
        self.conv1d = nn.Conv1d(width, width, config.conv_kernel, groups=width, bias=config.use_conv_bias)
        self.x_proj = nn.Linear(width, config.time_step_rank + 2 * states, bias=False)
        self.dt_proj = nn.Linear(config.time_step_rank, width, bias=True)
        self.A_log = nn.Parameter(torch.empty(width, states))
        self.D = nn.Parameter(torch.empty(width))
        self.out_proj = nn.Linear(width, hidden, bias=config.use_bias)
        self.act = ACT2FN[config.hidden_act]

    @property
    def o_proj(self) -> nn.Linear:
        """The projection back into the residual stream, under the protocol's name (GPT-2's scaled init)."""
        return self.out_proj

    def init_parameters(self, config: ZooMambaConfig) -> None:
        # the paper's init (S4D-real A, D = 1, Δ log-uniform in [time_step_min, time_step_max]), as MambaMixer's
        states = torch.arange(1, config.state_size + 1, dtype=torch.float32).expand(config.intermediate_size, -1)
        init.copy_(self.A_log, torch.log(states))
        init.ones_(self.D)
        std = config.time_step_rank**-0.5 * config.time_step_scale
        init.uniform_(self.dt_proj.weight, -std, std)
        low, high = math.log(config.time_step_min), math.log(config.time_step_max)
        dt = torch.exp(torch.rand(config.intermediate_size) * (high - low) + low).clamp(min=config.time_step_floor)
        init.copy_(self.dt_proj.bias, dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
        if self.conv1d.bias is not None:
            init.zeros_(self.conv1d.bias)

    @classmethod
    def query_key_width(cls, config: ZooMambaConfig) -> int:
        return config.state_size  # B and C play the keys' and queries' part

    @classmethod
    def value_width(cls, config: ZooMambaConfig) -> int:
        return config.intermediate_size

    @classmethod
    def rotary_dim(cls, config: ZooMambaConfig) -> int:
        return 0

    @classmethod
    def mixing_flops_per_token(cls, config: ZooMambaConfig, seq_len: int) -> float:
        # per channel: the convolution (2·k), the state update and read (Δ_t A, Δ_t B_t x_t, the decay times the
        # state, the sum and C_t h_t: 2·N each of multiply-adds, counted as 3·2·N) and the skip and gate (4)
        width, states = config.intermediate_size, config.state_size
        return width * (2 * config.conv_kernel + 6 * states + 4)

    @classmethod
    def attention_weights_absence(cls, config: ZooMambaConfig) -> str:
        return "the selective scan has no attention weights: each token reads a state that folds in the ones before"

    @classmethod
    def bidirectional_refusal(cls, config: ZooMambaConfig) -> str | None:
        return MAMBA_REFUSAL.format(model_type=config.model_type, field="an encoder layer")

    @classmethod
    def lora_modules(cls, config: ZooMambaConfig) -> tuple[str, ...]:
        return cls.lora_targets

    def forward(self, hidden_states, attention_mask: TokenMask, position_embeddings=None, cache=None, **kwargs):
        batch, length, _ = hidden_states.shape
        dtype = hidden_states.dtype
        padding = attention_mask.padding if attention_mask is not None else None  # (B, T) or None
        documents = attention_mask.documents if attention_mask is not None else None
        if documents is not None and not torch.compiler.is_compiling() and not bool(documents[:, -1].any()):
            # one document per row (no cache, no padding mask: transformers' packed-row rule still applies) is the
            # plain row: the same kernel, so a forward gives the same bits with or without use_cache
            documents = None
        x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, T, 2D) -> (B, T, D) x 2
        if padding is not None:  # padding enters neither the convolution nor the state
            x = x * padding[..., None].to(x.dtype)
        x = x.transpose(1, 2)  # (B, T, D) -> (B, D, T)
        layer = state_layer(cache, self.layer_idx, self.config.model_type)
        held = layer and layer.read()
        past = held["conv"] if held else x.new_zeros(batch, self.intermediate_size, self.conv_kernel_size - 1)
        inputs = torch.cat((past, x), dim=-1)  # (B, D, k - 1 + T): what the next step's window starts from
        x = self.act(causal_conv(self.conv1d, x, past, documents))  # (B, D, T)
        # contiguous inputs (here and for dt_proj): a matmul over a strided view may round differently from one buffer
        # to another (measured: LoRA-wrapped projections, 2e-6)
        time_step, B, C = self.x_proj(x.transpose(1, 2).contiguous()).split(
            [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )  # (B, T, R), (B, T, N), (B, T, N)
        delta = F.softplus(self.dt_proj(time_step.contiguous())).float().transpose(1, 2)  # (B, T, D) -> (B, D, T)
        if padding is not None:  # Δ = 0: the state passes a padding token unchanged
            delta = delta * padding[:, None, :].to(delta.dtype)
        A = -torch.exp(self.A_log.float())  # (D, N)
        # the scan runs in float32 whatever the model's dtype, as MambaMixer's
        state = held["ssm"] if held else None
        chunk = self.config.scan_chunk_size
        y, state = selective_scan(x.float(), delta, A, B.float(), C.float(), state, chunk, documents)
        y = (y + x.float() * self.D.float()[None, :, None]) * F.silu(gate.float().transpose(1, 2))  # (B, D, T)
        if layer is not None:
            layer.write({"conv": inputs[..., inputs.shape[-1] - (self.conv_kernel_size - 1) :], "ssm": state}, length)
        y = y.transpose(1, 2).to(dtype).contiguous()  # (B, D, T) -> (B, T, D), contiguous as x_proj's input
        return self.out_proj(y), None  # (B, T, hidden)


class ZooMambaModel(ZooModel):
    config_class = ZooMambaConfig
    attention_class = ZooMambaMixer


(
    ZooMambaForCausalLM,
    ZooMambaForSequenceClassification,
    ZooMambaForTokenClassification,
    ZooMambaForQuestionAnswering,
) = variant_heads(ZooMambaModel)
