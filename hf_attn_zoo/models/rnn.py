"""`zoo_rnn`: the recurrent encoder-decoder translator with attention, as a transformers sequence-to-sequence model.

A GRU or LSTM encoder (bidirectional by default) reads the source; a decoder RNN of the same cell, started from the
encoder's final state, writes the target one token at a time and, at every step, looks back at all encoder outputs
through one of three `attention` kinds:

- `"bahdanau"` follows Bahdanau, Cho & Bengio 2015 (arXiv 1409.0473): additive scores `e_tj = v^T tanh(W s_{t-1} +
  U h_j)` from the *previous* decoder state, and the context `c_t` enters the RNN with the embedded previous token,
  `s_t = RNN([E y_{t-1}; c_t], s_{t-1})`. Where this differs from the paper: the output layer is `tanh(W_o [c_t;
  s_t])` over the new state instead of the paper's maxout "deep output" over `(s_{t-1}, y_{t-1}, c_i)`, so that the
  three kinds share one output layer and differ only in how they score and where the context enters; the initial
  state is `tanh(W_s [h_S^fwd; h_1^bwd])` (both directions' final states, where the paper uses the backward one).
- `"luong"` follows Luong, Pham & Manning 2015 (arXiv 1508.04025), global attention with the "general" score
  `e_tj = s_t^T W_a h_j` computed *after* the RNN step, and the attentional hidden state `h~_t = tanh(W_c [c_t;
  s_t])` fed to the output layer. Without the paper's optional input feeding (`h~_{t-1}` concatenated to the next
  input): the decoder RNN then runs over the whole target in one call in training, and the model stays the plain
  global-attention form of the paper's section 3.1.
- `"none"` is the fixed-vector encoder-decoder of Sutskever et al. 2014 (arXiv 1409.3215) and Cho et al. 2014 (arXiv
  1406.1078): the decoder is initialised from the encoder's final state and reads nothing else, the baseline whose
  single vector is "too small" for long sentences. Unlike Sutskever, the source is not reversed, and unlike Cho the
  summary is not fed again at every step: only the initial state carries the source.

The encoder runs on packed sequences (`pack_padded_sequence`), so a padded row gives what the row alone gives, left or
right padded. The decoder's initial state is bridged by a linear map from the encoder's top-layer final state (one per
decoder layer, `tanh` for the hidden state; the LSTM's cell state gets its own linear map). Source padding is masked in
every attention. The decoding cache (`ZooRNNCache`) holds the decoder RNN state and, filled once at the first step, the
encoder outputs, their projected keys and the source mask: each step then costs one RNN step and one attention read,
and beam search reorders all of it with the batch.

Names follow BART/Marian: `model.shared` (one vocabulary for source and target), `model.encoder`, `model.decoder`,
`decoder.encoder_attn` (the cross-attention), `lm_head`, and `shift_tokens_right` for labels.

This module is copied next to every saved checkpoint (remote code), so it imports only torch, transformers and its
sibling modules. It is longer than the project's ~600-line guide because it is one whole model read top to bottom
(config, encoder, the two attentions, decoder, cache, heads), as every variant is one file: it shares no backbone
with the Transformer models that a split would let it import.
"""

import inspect
import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import can_return_tuple

from .cache_zoo import ZooStateCache
from .checkpoint_zoo import ShapeCheckedLoading, auto_map_for
from .compat_zoo import CACHE_KWARG, ZooConfigBase, takes_past_key_values
from .configuration_zoo import PresetConfig
from .encoder_decoder_zoo import SharedEmbeddingModel, TranslatorHead, shift_tokens_right

CELLS = ("gru", "lstm")
ATTENTIONS = ("bahdanau", "luong", "none")
RNN_CLASSES = {"gru": nn.GRU, "lstm": nn.LSTM}


class ZooRNNConfig(PresetConfig, ZooConfigBase):  # transformers' PreTrainedConfig (a fallback before 5.4: compat_zoo)
    r"""
    Configuration of the RNN encoder-decoder translator (`zoo_rnn`).

    Args:
        vocab_size (`int`): tokens of the shared source/target vocabulary (embedding and output head).
        hidden_size (`int`): width of the token embeddings and of the decoder's output layer (the attentional hidden
            state that `lm_head` reads, so that the head can be tied to the embedding).
        rnn_hidden_size (`int`, *optional*): state size of the encoder RNN (per direction) and of the decoder RNN;
            defaults to `hidden_size`.
        attention_hidden_size (`int`, *optional*): width of Bahdanau's `v`, `W` and `U`; defaults to
            `rnn_hidden_size`. Only for `attention="bahdanau"`.
        cell (`str`): `"gru"` or `"lstm"`, for the encoder and the decoder.
        num_layers (`int`): stacked RNN layers of the encoder and of the decoder (`num_hidden_layers` is an alias).
        bidirectional_encoder (`bool`): run the encoder in both directions (encoder outputs are then
            `2 * rnn_hidden_size` wide).
        attention (`str`): `"bahdanau"` (additive, before the RNN step), `"luong"` (multiplicative "general", after the
            RNN step) or `"none"` (fixed-vector encoder-decoder); see the module docstring.
        dropout (`float`): dropout on the embeddings, between stacked RNN layers and on the decoder's output layer.
        initializer_range (`float`): standard deviation of the normal initialisation of embeddings and linear maps
            (the RNNs keep PyTorch's uniform initialisation). 0.1, the scale of Luong et al.'s uniform [-0.1, 0.1]:
            at a Transformer's 0.02 the tied embedding and output layer of a small translator start too small for
            it to learn (its loss stayed at the unigram level at every learning rate tried).
        pad_token_id, bos_token_id, eos_token_id (`int`): special tokens of the vocabulary.
        decoder_start_token_id (`int`): the first decoder input (labels are shifted right behind it).
        tie_word_embeddings (`bool`): share the embedding with the output head.
    """

    model_type = "zoo_rnn"
    attribute_map: ClassVar[dict[str, str]] = {"num_hidden_layers": "num_layers"}
    keys_to_ignore_at_inference: ClassVar[list[str]] = [CACHE_KWARG, "encoder_last_hidden_state"]

    description: ClassVar[str] = "GRU/LSTM encoder-decoder with Bahdanau or Luong attention (or none)"
    paper: ClassVar[str] = "Bahdanau et al. 2015; Luong et al. 2015; Sutskever et al. 2014; Cho et al. 2014"
    arxiv: ClassVar[tuple[str, ...]] = ("1409.0473", "1508.04025", "1409.3215", "1406.1078")
    # tiny for tests and smoke runs, small for CPUs, base for GPUs: 0.5M, 6M and 63M parameters at the default
    # 16k vocabulary (the shared embedding is most of the small ones)
    presets: ClassVar[dict[str, dict]] = {
        "tiny": {"hidden_size": 32, "rnn_hidden_size": 32, "num_layers": 1},
        "small": {"hidden_size": 256, "rnn_hidden_size": 256, "num_layers": 1},
        "base": {"hidden_size": 512, "rnn_hidden_size": 1024, "num_layers": 2},
    }

    vocab_size: int = 16000
    hidden_size: int = 256
    rnn_hidden_size: int | None = None
    attention_hidden_size: int | None = None
    cell: str = "gru"
    num_layers: int = 1
    bidirectional_encoder: bool = True
    attention: str = "bahdanau"
    dropout: float = 0.1
    initializer_range: float = 0.1
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1
    is_encoder_decoder: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        if self.rnn_hidden_size is None:
            self.rnn_hidden_size = self.hidden_size
        if self.attention_hidden_size is None:
            self.attention_hidden_size = self.rnn_hidden_size
        super().__post_init__(**kwargs)
        self.is_encoder_decoder = True  # what the model is, whatever the base class's defaults say
        self.validate()

    @property
    def encoder_output_size(self) -> int:
        """Width of the encoder outputs: both directions' states side by side when bidirectional."""
        return self.rnn_hidden_size * (2 if self.bidirectional_encoder else 1)

    def validate(self) -> None:
        """Run transformers' own checks, then the model's; raises `ValueError` naming the field and the fix."""
        super().validate()
        for name in ("vocab_size", "hidden_size", "rnn_hidden_size", "attention_hidden_size", "num_layers"):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.cell not in CELLS:
            raise ValueError(f"cell={self.cell!r} is not supported; use one of {list(CELLS)}.")
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention={self.attention!r} is not supported; use 'bahdanau' (additive, Bahdanau et al. 2015), "
                f"'luong' (multiplicative 'general', Luong et al. 2015) or 'none' (fixed-vector encoder-decoder)."
            )
        if not isinstance(self.bidirectional_encoder, bool):
            raise ValueError(f"bidirectional_encoder must be True or False, got {self.bidirectional_encoder!r}.")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {self.dropout!r}.")
        if not isinstance(self.initializer_range, (int, float)) or self.initializer_range <= 0:
            raise ValueError(f"initializer_range must be a positive number, got {self.initializer_range!r}.")
        for name in ("pad_token_id", "decoder_start_token_id"):
            if getattr(self, name) is None:
                raise ValueError(
                    f"{name} must be set: labels are shifted right behind decoder_start_token_id, with -100 replaced "
                    f"by pad_token_id (as BART does); give the tokenizer's ids."
                )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, list) else [value]:
                if token is not None and not (_is_int(token) and 0 <= token < self.vocab_size):
                    raise ValueError(
                        f"{name}={value!r} is not a token of the vocabulary (0 to vocab_size - 1 = "
                        f"{self.vocab_size - 1}); give the tokenizer's id or raise vocab_size."
                    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value) -> bool:
    return _is_int(value) and value > 0


def run_packed(rnn: nn.RNNBase, inputs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`rnn` over the real tokens of each row only (`mask` 1), left or right padded; zeros at the padding.

    The real tokens of each row are moved to its front in order (a stable sort puts the padding behind them), run as a
    packed batch, and put back where they came from: every row gets exactly what it gets alone."""
    batch, length, _ = inputs.shape
    lengths = mask.sum(dim=1)  # (B,)
    order = torch.argsort(mask.eq(0).to(torch.int32), dim=1, stable=True)  # (B, S): real positions first
    compact = inputs.gather(1, order[..., None].expand_as(inputs))  # (B, S, d): each row's tokens from slot 0
    packed = pack_padded_sequence(compact, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
    outputs, _ = rnn(packed)
    outputs, _ = pad_packed_sequence(outputs, batch_first=True, total_length=length)  # (B, S, E), zeros past length
    outputs = outputs * (torch.arange(length, device=mask.device)[None, :] < lengths[:, None])[..., None]
    return torch.zeros_like(outputs).scatter(1, order[..., None].expand_as(outputs), outputs)  # (B, S, E)


def masked_softmax(scores: torch.Tensor, source_mask: torch.Tensor) -> torch.Tensor:
    """Softmax of `scores` (B, T, S) over the source positions where `source_mask` (B, S) is true."""
    scores = scores.masked_fill(~source_mask[:, None, :], torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1)


class ZooBahdanauAttention(nn.Module):
    """Additive attention (Bahdanau et al. 2015): `e_tj = v^T tanh(W s + U h_j)`, `U h_j` computed once per source."""

    sized_by: ClassVar[dict[str, str]] = {
        "query_proj": "attention_hidden_size, rnn_hidden_size",
        "key_proj": "attention_hidden_size, rnn_hidden_size, bidirectional_encoder",
        "v": "attention_hidden_size",
    }

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__()
        self.query_proj = nn.Linear(config.rnn_hidden_size, config.attention_hidden_size, bias=False)  # W
        self.key_proj = nn.Linear(config.encoder_output_size, config.attention_hidden_size, bias=False)  # U
        self.v = nn.Linear(config.attention_hidden_size, 1, bias=False)

    def project_keys(self, memory: torch.Tensor) -> torch.Tensor:
        return self.key_proj(memory)  # (B, S, A)

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, memory: torch.Tensor, source_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context (B, T, E) and weights (B, T, S) for queries (B, T, D) over keys (B, S, A) and memory (B, S, E)."""
        energy = torch.tanh(self.query_proj(query)[:, :, None, :] + keys[:, None, :, :])  # (B, T, S, A)
        weights = masked_softmax(self.v(energy).squeeze(-1), source_mask)  # (B, T, S)
        return weights @ memory, weights


class ZooLuongAttention(nn.Module):
    """Multiplicative "general" attention (Luong et al. 2015): `e_tj = s_t^T W_a h_j`, `W_a h_j` computed once."""

    sized_by: ClassVar[dict[str, str]] = {"key_proj": "rnn_hidden_size, bidirectional_encoder"}

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__()
        self.key_proj = nn.Linear(config.encoder_output_size, config.rnn_hidden_size, bias=False)  # W_a

    def project_keys(self, memory: torch.Tensor) -> torch.Tensor:
        return self.key_proj(memory)  # (B, S, D)

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, memory: torch.Tensor, source_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context (B, T, E) and weights (B, T, S) for queries (B, T, D) over keys (B, S, D) and memory (B, S, E)."""
        weights = masked_softmax(query @ keys.transpose(1, 2), source_mask)  # (B, T, S)
        return weights @ memory, weights


ATTENTION_CLASSES = {"bahdanau": ZooBahdanauAttention, "luong": ZooLuongAttention}


class ZooRNNCache(ZooStateCache):
    """The decoding cache: one state layer holding the decoder RNN state `hidden` (and the LSTM's `cell`), each
    (B, num_layers, D), and, written at the first step, the encoder outputs `memory` (B, S, E), their projected
    attention `keys` and the `source_mask` (B, S). Everything is batch-first, so beam search reorders it all."""

    def __init__(self) -> None:
        super().__init__(num_layers=1)


class ZooRNNEncoder(nn.Module):
    """The source embedding and the (bidirectional) encoder RNN, run on packed sequences."""

    sized_by: ClassVar[dict[str, str]] = {
        "embed_tokens": "vocab_size, hidden_size",
        "rnn": "hidden_size, rnn_hidden_size, num_layers, cell, bidirectional_encoder",
    }

    def __init__(self, config: ZooRNNConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.embed_tokens = embed_tokens
        self.rnn = RNN_CLASSES[config.cell](
            config.hidden_size,
            config.rnn_hidden_size,
            num_layers=config.num_layers,
            batch_first=True,
            dropout=config.dropout if config.num_layers > 1 else 0.0,
            bidirectional=config.bidirectional_encoder,
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        """Encoder outputs (B, S, E), zeros at padded positions; with `output_hidden_states` also the embeddings."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds to the encoder.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, S, d)
        if attention_mask is None:
            attention_mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeds = F.dropout(inputs_embeds, self.dropout, self.training)
        outputs = run_packed(self.rnn, embeds, attention_mask.bool())  # (B, S, E)
        hidden_states = (inputs_embeds, outputs) if output_hidden_states else None
        if return_dict is False:
            return tuple(value for value in (outputs, hidden_states) if value is not None)
        return BaseModelOutput(last_hidden_state=outputs, hidden_states=hidden_states)


class ZooRNNDecoder(nn.Module):
    """The target embedding, the bridge from the encoder's final state, the decoder RNN, the cross-attention
    (`encoder_attn`) and the output layer whose result (B, T, hidden_size) the head reads."""

    sized_by: ClassVar[dict[str, str]] = {
        "embed_tokens": "vocab_size, hidden_size",
        "bridge": "rnn_hidden_size, num_layers, bidirectional_encoder",
        "bridge_cell": "rnn_hidden_size, num_layers, bidirectional_encoder",
        "rnn": "hidden_size, rnn_hidden_size, num_layers, cell, attention",
        "output_proj": "hidden_size, rnn_hidden_size, attention, bidirectional_encoder",
    }

    def __init__(self, config: ZooRNNConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.attention = config.attention
        self.cell = config.cell
        self.num_layers = config.num_layers
        self.state_size = config.rnn_hidden_size
        self.bidirectional_encoder = config.bidirectional_encoder
        self.dropout = config.dropout
        self.embed_tokens = embed_tokens
        encoder_size = config.encoder_output_size
        self.bridge = nn.Linear(encoder_size, config.num_layers * config.rnn_hidden_size)
        if config.cell == "lstm":
            self.bridge_cell = nn.Linear(encoder_size, config.num_layers * config.rnn_hidden_size)
        # Bahdanau's context enters the RNN beside the embedded previous token
        input_size = config.hidden_size + (encoder_size if config.attention == "bahdanau" else 0)
        self.rnn = RNN_CLASSES[config.cell](
            input_size,
            config.rnn_hidden_size,
            num_layers=config.num_layers,
            batch_first=True,
            dropout=config.dropout if config.num_layers > 1 else 0.0,
        )
        if config.attention != "none":
            self.encoder_attn = ATTENTION_CLASSES[config.attention](config)
        features = config.rnn_hidden_size + (encoder_size if config.attention != "none" else 0)
        self.output_proj = nn.Linear(features, config.hidden_size)  # W_o / Luong's W_c over [c_t; s_t]

    def initial_state(self, memory: torch.Tensor, source_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoder's start state from the encoder's top-layer final state: the forward direction's output at the
        last real token, the backward direction's at the first. Read off the encoder outputs, so that precomputed
        `encoder_outputs` are all the decoder needs."""
        batch, length, _ = memory.shape
        rows = torch.arange(batch, device=memory.device)
        last = length - 1 - source_mask.flip(1).long().argmax(dim=1)  # (B,) index of each row's last real token
        summary = memory[rows, last, : self.state_size]  # (B, D)
        if self.bidirectional_encoder:
            first = source_mask.long().argmax(dim=1)  # (B,) index of each row's first real token
            summary = torch.cat([summary, memory[rows, first, self.state_size :]], dim=-1)  # (B, 2D)
        state = {"hidden": torch.tanh(self.bridge(summary)).view(batch, self.num_layers, self.state_size)}
        if self.cell == "lstm":
            state["cell"] = self.bridge_cell(summary).view(batch, self.num_layers, self.state_size)  # (B, L, D)
        return state

    def _rnn_state(self, state: dict[str, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The cache's batch-first state as torch's RNN takes it: (L, B, D), a pair for the LSTM."""
        hidden = state["hidden"].transpose(0, 1).contiguous()  # (B, L, D) -> (L, B, D)
        if self.cell == "lstm":
            return hidden, state["cell"].transpose(0, 1).contiguous()
        return hidden

    def _cache_state(self, rnn_state: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.cell == "lstm":
            return {"hidden": rnn_state[0].transpose(0, 1), "cell": rnn_state[1].transpose(0, 1)}  # (B, L, D) each
        return {"hidden": rnn_state.transpose(0, 1)}  # (L, B, D) -> (B, L, D)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: ZooRNNCache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Output features (B, T, hidden_size), attention weights (B, T, S) or None, and the input embeddings.

        Without a cache (or with an empty one) the state starts from `encoder_hidden_states`; with a filled cache it
        continues from the cache, which then also provides the encoder outputs."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of decoder_input_ids or decoder_inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        layer = cache.layers[0] if cache is not None else None
        state = layer.read() if layer is not None else None
        if state is None:
            if encoder_hidden_states is None:
                raise ValueError("The first decoding step needs the encoder: pass input_ids or encoder_outputs.")
            memory = encoder_hidden_states
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device)
            source_mask = encoder_attention_mask.bool()
            keys = self.encoder_attn.project_keys(memory) if self.attention != "none" else None
            state = self.initial_state(memory, source_mask)
        else:
            memory, keys, source_mask = state.get("memory"), state.get("keys"), state.get("source_mask")
        rnn_state = self._rnn_state(state)
        embeds = F.dropout(inputs_embeds, self.dropout, self.training)

        weights = None
        if self.attention == "bahdanau":
            # the context of step t is scored from the state before it, so the steps run one by one
            outputs, contexts, step_weights = [], [], []
            for t in range(embeds.shape[1]):
                top = (rnn_state[0] if self.cell == "lstm" else rnn_state)[-1]  # (B, D): s_{t-1}, top layer
                context, step_weight = self.encoder_attn(top[:, None, :], keys, memory, source_mask)  # (B, 1, E)
                step_input = torch.cat([embeds[:, t : t + 1], context], dim=-1)  # (B, 1, d + E)
                output, rnn_state = self.rnn(step_input, rnn_state)  # (B, 1, D)
                outputs.append(output)
                contexts.append(context)
                step_weights.append(step_weight)
            rnn_outputs = torch.cat(outputs, dim=1)  # (B, T, D)
            contexts = torch.cat(contexts, dim=1)  # (B, T, E)
            weights = torch.cat(step_weights, dim=1)  # (B, T, S)
            features = torch.cat([contexts, rnn_outputs], dim=-1)  # (B, T, E + D)
        else:
            rnn_outputs, rnn_state = self.rnn(embeds, rnn_state)  # (B, T, D)
            features = rnn_outputs
            if self.attention == "luong":
                contexts, weights = self.encoder_attn(rnn_outputs, keys, memory, source_mask)  # (B, T, E)
                features = torch.cat([contexts, rnn_outputs], dim=-1)  # (B, T, E + D)
        hidden = F.dropout(torch.tanh(self.output_proj(features)), self.dropout, self.training)  # (B, T, d)

        if layer is not None:
            new_state = self._cache_state(rnn_state)
            if self.attention != "none":
                new_state |= {"memory": memory, "keys": keys, "source_mask": source_mask}
            layer.write(new_state, embeds.shape[1])
        return hidden, (weights if output_attentions else None), inputs_embeds


class ZooRNNPreTrainedModel(ShapeCheckedLoading, PreTrainedModel):
    config_class = ZooRNNConfig
    config: ZooRNNConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules: ClassVar[list[str]] = ["ZooRNNEncoder", "ZooRNNDecoder"]
    _skip_keys_device_placement: ClassVar[list[str]] = [CACHE_KWARG]
    # the Auto classes besides AutoConfig/AutoModel that load this model (the registry and `auto_map` read it)
    heads: ClassVar[dict[str, type]] = {}

    def __init__(self, config: ZooRNNConfig, *inputs, **kwargs) -> None:
        config.validate()  # a config may have been mutated after construction
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # normal(initializer_range) for embeddings and linear maps, zero biases
        if isinstance(module, nn.RNNBase):  # PyTorch's own RNN initialisation, which transformers does not know
            bound = 1.0 / math.sqrt(module.hidden_size)
            for parameter in module.parameters():
                init.uniform_(parameter, -bound, bound)

    def make_cache(self) -> ZooRNNCache:
        """An empty decoding cache; the first forward fills it."""
        return ZooRNNCache()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained` with an `auto_map` naming the config, the base model and the translator,
        so the checkpoint loads with `trust_remote_code=True` through each of their Auto classes."""
        self.config.auto_map = auto_map_for(ZooRNNModel)
        return super().save_pretrained(save_directory, *args, **kwargs)


class ZooRNNModel(SharedEmbeddingModel, ZooRNNPreTrainedModel):
    """The encoder and the decoder over one shared embedding (`model.shared`), returning the decoder's output
    features; `ZooRNNForConditionalGeneration` adds the head."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.encoder = ZooRNNEncoder(config, self.shared)
        self.decoder = ZooRNNDecoder(config, self.shared)
        self.post_init()

    sized_by: ClassVar[dict[str, str]] = {"shared": "vocab_size, hidden_size"}

    @takes_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,  # consumed by @can_return_tuple: False returns a tuple
        **kwargs,
    ) -> Seq2SeqModelOutput:
        r"""
        decoder_attention_mask: accepted for the Seq2Seq interface and not read: the decoder RNN is causal, so right
            padding of the target changes nothing before it, and padded label positions are -100 for the loss.
        encoder_outputs: the encoder's output for these sources, reused instead of running the encoder again.
        cache (`ZooRNNCache`): the decoding state; with one that is filled, only the new target tokens are given and
            the encoder is not needed.
        """
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if cache is not None and not isinstance(cache, ZooRNNCache):
            raise TypeError(
                f"zoo_rnn decodes from its RNN state and cannot use a {type(cache).__name__}; pass "
                f"cache=model.make_cache(), or let generate() create it."
            )
        if use_cache and cache is None:
            cache = self.make_cache()
        cache_filled = cache is not None and cache.get_seq_length() > 0
        if encoder_outputs is None and not cache_filled:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_hidden_states=output_hidden_states,
                return_dict=True,
            )
        elif isinstance(encoder_outputs, (tuple, list)):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
            )
        hidden, weights, decoder_embeds = self.decoder(
            input_ids=decoder_input_ids,
            inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state if encoder_outputs is not None else None,
            encoder_attention_mask=attention_mask,
            cache=cache,
            output_attentions=output_attentions,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=hidden,
            **{CACHE_KWARG: cache if use_cache else None},
            decoder_hidden_states=(decoder_embeds, hidden) if output_hidden_states else None,
            cross_attentions=(weights[:, None],) if weights is not None else None,  # (B, 1, T, S): one "head"
            encoder_last_hidden_state=encoder_outputs.last_hidden_state if encoder_outputs is not None else None,
            encoder_hidden_states=encoder_outputs.hidden_states if encoder_outputs is not None else None,
        )


class ZooRNNForConditionalGeneration(TranslatorHead, ZooRNNPreTrainedModel, GenerationMixin):
    """The translator: `ZooRNNModel` and a language-modelling head over the decoder's output features."""

    model_class: ClassVar[type[ZooRNNModel]] = ZooRNNModel
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.shared.weight"}
    sized_by: ClassVar[dict[str, str]] = {"lm_head": "vocab_size, hidden_size"}

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__(config)
        self.model = ZooRNNModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def make_cache(self) -> ZooRNNCache:
        return self.model.make_cache()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs) -> None:
        """`generate` would build transformers' key/value caches; this model decodes from its RNN state, so it
        starts a `ZooRNNCache` instead and refuses cache implementations (static, quantized, offloaded) that
        presuppose keys and values."""
        cache = model_kwargs.get(CACHE_KWARG)
        if cache is not None:
            if not isinstance(cache, ZooRNNCache):
                raise TypeError(
                    f"zoo_rnn decodes from its RNN state and cannot use a {type(cache).__name__}; pass "
                    f"{CACHE_KWARG}=model.make_cache(), or leave it to generate()."
                )
            cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"zoo_rnn decodes from its RNN state, not from keys and values: cache_implementation="
                f"{generation_config.cache_implementation!r} does not apply; leave it unset."
            )
        model_kwargs[CACHE_KWARG] = self.make_cache()

    @takes_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,  # consumed by @can_return_tuple: False returns a tuple
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*): target tokens, -100 where
            ignored. Without decoder inputs they are shifted right into them (`shift_tokens_right`), as BART does; the
            loss is the mean cross-entropy over the labels that are not -100 (or their sum over
            `num_items_in_batch`, which the Trainer passes under gradient accumulation).
        """
        if labels is not None:
            use_cache = False  # training: no decoding state to keep
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(outputs.last_hidden_state)  # (B, T, vocab)
        loss = None
        if labels is not None:
            flat_logits, flat_labels = logits.flatten(0, 1).float(), labels.to(logits.device).flatten()  # (B*T, V)
            num_items = kwargs.get("num_items_in_batch")
            if num_items is None:
                loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
            else:
                loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum") / num_items
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
            decoder_hidden_states=outputs.decoder_hidden_states,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
        )


ZooRNNModel.heads = {"AutoModelForSeq2SeqLM": ZooRNNForConditionalGeneration}

# Classes registered with `register_for_auto_class` count as remote code, for which `generate` reads
# `inspect.signature(self.forward)` at every decoding step: a precomputed signature makes that an attribute read.
ZooRNNForConditionalGeneration.forward.__signature__ = inspect.signature(ZooRNNForConditionalGeneration.forward)

__all__ = [
    "ZooRNNCache",
    "ZooRNNConfig",
    "ZooRNNForConditionalGeneration",
    "ZooRNNModel",
    "ZooRNNPreTrainedModel",
    "shift_tokens_right",
]
