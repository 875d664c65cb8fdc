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

Names follow BART/Marian: `model.shared` (one vocabulary for source and target, tied to `model.encoder.embed_tokens`
and `model.decoder.embed_tokens`), `model.encoder`, `model.decoder`, `decoder.encoder_attn` (the cross-attention),
`lm_head`, and `shift_tokens_right` for labels. The bare model's forward, the head (loss, output, the cache
`generate` starts) and the embeddings' ties are every translator's, in `translator_zoo.py`; this file is the network.

This module is copied next to every saved checkpoint (remote code), so it imports only torch, transformers and its
sibling modules.
"""

import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions
from transformers.modeling_utils import PreTrainedModel

from .cache_zoo import ZooStateCache
from .checkpoint_zoo import ShapeCheckedLoading, auto_map_for
from .compat_zoo import CACHE_KWARG, ZooConfigBase
from .configuration_zoo import PresetConfig, _is_positive_int, check_choice, is_int
from .translator_zoo import ZooTranslatorForConditionalGeneration, ZooTranslatorModel, shift_tokens_right

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
        check_choice("cell", self.cell, CELLS)
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
                if token is not None and not (is_int(token) and 0 <= token < self.vocab_size):
                    raise ValueError(
                        f"{name}={value!r} is not a token of the vocabulary (0 to vocab_size - 1 = "
                        f"{self.vocab_size - 1}); give the tokenizer's id or raise vocab_size."
                    )


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


def tied_embedding(config: ZooRNNConfig) -> nn.Embedding:
    """An encoder's or decoder's `embed_tokens`, whose weight transformers ties to `model.shared`'s: neither built nor
    initialised with random numbers (`_init_weights` passes it over), so that a seed initialises the model as it did
    when both sides read `shared` itself."""
    weight = torch.empty(config.vocab_size, config.hidden_size)  # (V, d), replaced by the tie
    embedding = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id, _weight=weight)
    embedding.tied_to_shared = True
    return embedding


class ZooRNNEncoder(nn.Module):
    """The source embedding and the (bidirectional) encoder RNN, run on packed sequences."""

    sized_by: ClassVar[dict[str, str]] = {
        "embed_tokens": "vocab_size, hidden_size",
        "rnn": "hidden_size, rnn_hidden_size, num_layers, cell, bidirectional_encoder",
    }

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__()
        self.config = config
        self.dropout = config.dropout
        self.embed_tokens = tied_embedding(config)
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
        if output_hidden_states is None:  # a flag left at None falls back to the config, as in transformers
            output_hidden_states = self.config.output_hidden_states
        embeds = F.dropout(inputs_embeds, self.dropout, self.training)
        outputs = run_packed(self.rnn, embeds, attention_mask.bool())  # (B, S, E)
        hidden_states = (inputs_embeds, outputs) if output_hidden_states else None
        if return_dict is False:
            return tuple(value for value in (outputs, hidden_states) if value is not None)
        return BaseModelOutput(last_hidden_state=outputs, hidden_states=hidden_states)


class ZooRNNDecoder(nn.Module):
    """The target embedding, the bridge from the encoder's final state, the decoder RNN, the cross-attention
    (`encoder_attn`) and the output layer whose result (B, T, hidden_size) the head reads.

    Split as JoeyNMT's RNN decoder is: `start_state` (the state before the first target token, from the encoder),
    `step` (one RNN step over the target tokens it can take at once, with its attention) and `forward` (reading and
    writing the cache, and the loop over steps where the attention must see each state before the next)."""

    sized_by: ClassVar[dict[str, str]] = {
        "embed_tokens": "vocab_size, hidden_size",
        "bridge": "rnn_hidden_size, num_layers, bidirectional_encoder",
        "bridge_cell": "rnn_hidden_size, num_layers, bidirectional_encoder",
        "rnn": "hidden_size, rnn_hidden_size, num_layers, cell, attention",
        "output_proj": "hidden_size, rnn_hidden_size, attention, bidirectional_encoder",
    }

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__()
        self.config = config
        self.attention = config.attention
        self.cell = config.cell
        self.num_layers = config.num_layers
        self.state_size = config.rnn_hidden_size
        self.bidirectional_encoder = config.bidirectional_encoder
        self.dropout = config.dropout
        self.embed_tokens = tied_embedding(config)
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

    def make_cache(self) -> ZooRNNCache:
        """An empty decoding cache; the first forward fills it."""
        return ZooRNNCache()

    def start_state(self, memory: torch.Tensor, source_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoder's state before the first target token: the source (`memory`, its attention `keys`,
        `source_mask`) and the RNN state bridged from the encoder's top-layer final state (the forward direction's
        output at the last real token, the backward direction's at the first). Read off the encoder outputs, so that
        precomputed `encoder_outputs` are all the decoder needs."""
        batch, length, _ = memory.shape
        rows = torch.arange(batch, device=memory.device)
        last = length - 1 - source_mask.flip(1).long().argmax(dim=1)  # (B,) index of each row's last real token
        summary = memory[rows, last, : self.state_size]  # (B, D)
        if self.bidirectional_encoder:
            first = source_mask.long().argmax(dim=1)  # (B,) index of each row's first real token
            summary = torch.cat([summary, memory[rows, first, self.state_size :]], dim=-1)  # (B, 2D)
        # (B, L * D) -> (B, L, D)
        state = {"hidden": torch.tanh(self.bridge(summary)).view(batch, self.num_layers, self.state_size)}
        if self.cell == "lstm":
            state["cell"] = self.bridge_cell(summary).view(batch, self.num_layers, self.state_size)  # (B, L, D)
        if self.attention != "none":
            state |= {"memory": memory, "keys": self.encoder_attn.project_keys(memory), "source_mask": source_mask}
        return state

    def step(
        self, embeds: torch.Tensor, rnn_state, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | tuple]:
        """The RNN over `embeds` (B, T, d) from `rnn_state`, with the attention over the source in `state`: the
        features (B, T, E + D or D) the output layer reads, the attention weights (B, T, S) or None, the new RNN
        state. Bahdanau's attention reads the state before the step, so it takes one token (T = 1); Luong's reads the
        RNN's outputs after it, and the RNN runs over the whole target at once."""
        if self.attention == "bahdanau":
            top = (rnn_state[0] if self.cell == "lstm" else rnn_state)[-1]  # (B, D): s_{t-1}, top layer
            context, weights = self.encoder_attn(top[:, None, :], state["keys"], state["memory"], state["source_mask"])
            outputs, rnn_state = self.rnn(torch.cat([embeds, context], dim=-1), rnn_state)  # (B, 1, D)
            return torch.cat([context, outputs], dim=-1), weights, rnn_state  # (B, 1, E + D)
        outputs, rnn_state = self.rnn(embeds, rnn_state)  # (B, T, D)
        if self.attention == "none":
            return outputs, None, rnn_state
        context, weights = self.encoder_attn(outputs, state["keys"], state["memory"], state["source_mask"])
        return torch.cat([context, outputs], dim=-1), weights, rnn_state  # (B, T, E + D)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: ZooRNNCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """Output features (B, T, hidden_size), the cache, the input embeddings and the features as hidden states,
        the attention weights as one head's cross-attentions (B, 1, T, S).

        `attention_mask` (the target's) is accepted for the Seq2Seq interface and not read: the decoder RNN is
        causal, so right padding of the target changes nothing before it, and padded label positions are -100 for
        the loss. Without a cache (or with an empty one) the state starts from `encoder_hidden_states`; with a filled
        cache it continues from the cache, which then also provides the source."""
        config = self.config
        use_cache = use_cache if use_cache is not None else config.use_cache
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        if cache is not None and not isinstance(cache, ZooRNNCache):
            raise TypeError(
                f"zoo_rnn decodes from its RNN state and cannot use a {type(cache).__name__}; pass "
                f"{CACHE_KWARG}=model.make_cache(), or let generate() create it."
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of decoder_input_ids or decoder_inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if use_cache and cache is None:
            cache = self.make_cache()
        layer = cache.layers[0] if cache is not None else None
        state = layer.read() if layer is not None else None
        if state is None:
            if encoder_hidden_states is None:
                raise ValueError("The first decoding step needs the encoder: pass input_ids or encoder_outputs.")
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(encoder_hidden_states.shape[:2], device=inputs_embeds.device)
            state = self.start_state(encoder_hidden_states, encoder_attention_mask.bool())
        hidden = state["hidden"].transpose(0, 1).contiguous()  # (B, L, D) -> (L, B, D), as torch's RNN takes it
        rnn_state = (hidden, state["cell"].transpose(0, 1).contiguous()) if self.cell == "lstm" else hidden
        embeds = F.dropout(inputs_embeds, self.dropout, self.training)

        # Bahdanau's context of step t is scored from the state before it, so the steps run one by one
        steps = embeds.split(1, dim=1) if self.attention == "bahdanau" else (embeds,)
        features, weights = [], []
        for step_embeds in steps:
            step_features, step_weights, rnn_state = self.step(step_embeds, rnn_state, state)
            features.append(step_features)
            weights.append(step_weights)
        features = torch.cat(features, dim=1)  # (B, T, E + D or D)
        weights = torch.cat(weights, dim=1) if self.attention != "none" else None  # (B, T, S)
        hidden = F.dropout(torch.tanh(self.output_proj(features)), self.dropout, self.training)  # (B, T, d)

        if layer is not None:
            if self.cell == "lstm":  # (L, B, D) -> (B, L, D) each
                new_rnn_state = {"hidden": rnn_state[0].transpose(0, 1), "cell": rnn_state[1].transpose(0, 1)}
            else:
                new_rnn_state = {"hidden": rnn_state.transpose(0, 1)}
            layer.write(state | new_rnn_state, embeds.shape[1])
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden,
            **{CACHE_KWARG: cache if use_cache else None},
            hidden_states=(inputs_embeds, hidden) if output_hidden_states else None,
            # one "head": (B, 1, T, S)
            cross_attentions=(weights[:, None],) if output_attentions and weights is not None else None,
        )


class ZooRNNPreTrainedModel(ShapeCheckedLoading, PreTrainedModel):
    config_class = ZooRNNConfig
    config: ZooRNNConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _is_stateful = True  # decodes from an RNN state that cannot be rolled back: no assisted or prompt-lookup decoding
    _no_split_modules: ClassVar[list[str]] = ["ZooRNNEncoder", "ZooRNNDecoder"]
    _skip_keys_device_placement: ClassVar[list[str]] = [CACHE_KWARG]
    # the Auto classes besides AutoConfig/AutoModel that load this model (the registry and `auto_map` read it)
    heads: ClassVar[dict[str, type]] = {}

    def __init__(self, config: ZooRNNConfig, *inputs, **kwargs) -> None:
        config.validate()  # a config may have been mutated after construction
        super().__init__(config, *inputs, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if getattr(module, "tied_to_shared", False):
            return  # its weight is `shared`'s, initialised there
        super()._init_weights(module)  # normal(initializer_range) for embeddings and linear maps, zero biases
        if isinstance(module, nn.RNNBase):  # PyTorch's own RNN initialisation, which transformers does not know
            bound = 1.0 / math.sqrt(module.hidden_size)
            for parameter in module.parameters():
                init.uniform_(parameter, -bound, bound)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained` with an `auto_map` naming the config, the base model and the translator,
        so the checkpoint loads with `trust_remote_code=True` through each of their Auto classes."""
        self.config.auto_map = auto_map_for(ZooRNNModel)
        return super().save_pretrained(save_directory, *args, **kwargs)


class ZooRNNModel(ZooTranslatorModel, ZooRNNPreTrainedModel):
    """The encoder and the decoder over one vocabulary (`shared`, tied to both sides' `embed_tokens`), returning the
    decoder's output features; `ZooRNNForConditionalGeneration` adds the head."""

    def __init__(self, config: ZooRNNConfig) -> None:
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.encoder = ZooRNNEncoder(config)
        self.decoder = ZooRNNDecoder(config)
        self.post_init()


class ZooRNNForConditionalGeneration(ZooTranslatorForConditionalGeneration, ZooRNNPreTrainedModel, GenerationMixin):
    """The translator: `ZooRNNModel` and a language-modelling head over the decoder's output features."""

    model_class: ClassVar[type[ZooRNNModel]] = ZooRNNModel


ZooRNNModel.heads = {"AutoModelForSeq2SeqLM": ZooRNNForConditionalGeneration}

__all__ = [
    "ZooRNNCache",
    "ZooRNNConfig",
    "ZooRNNForConditionalGeneration",
    "ZooRNNModel",
    "ZooRNNPreTrainedModel",
    "shift_tokens_right",
]
