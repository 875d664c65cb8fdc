"""`ZooConfig`: the configuration every zoo variant shares.

Field names are the ones transformers uses for Llama (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
`head_dim`, `rope_parameters`, ...), so a Llama config maps onto a zoo config field by field. What a zoo config adds is
the choice of backbone pieces (`position_embedding_type`, `norm_type`, `mlp_type`, `hidden_dropout`,
`scale_residual_init`) and validation: a config that cannot build a working model raises `ValueError` naming the field
and the fix, at construction, at model construction and at save time.

Each variant subclasses `ZooConfig` with its own `model_type`, defaults and extra checks (`_check_variant`), and
declares what it is: the position types it supports, its paper and arXiv ids, a one-line description, its cache
formula and its presets (`tiny` for tests and smoke runs, `small` at about 10-20M parameters for CPUs, `base` at
about 125M for GPUs: the backbone sizes below with the variant's own fields on top).

This module is copied next to every saved checkpoint (see `save_pretrained`), so it imports nothing from the package.
"""

import math
from typing import ClassVar

from transformers.activations import ACT2FN

from .compat_zoo import CACHE_KWARG, ZooConfigBase

POSITION_EMBEDDING_TYPES = ("rope", "alibi", "sinusoidal", "learned", "none")
NORM_TYPES = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
MLP_TYPES = ("gated", "plain", "none")
CROSS_ATTENTIONS = ("dot", "additive")

# The backbone of each preset size; a variant's presets add its own fields (`sized`).
BACKBONE_SIZES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 256},
    "small": {"hidden_size": 384, "num_hidden_layers": 6, "max_position_embeddings": 1024},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "max_position_embeddings": 2048},
}
HEADS = (4, 6, 12)  # query heads of the tiny, small and base presets of the variants that have heads


def sized(**fields: tuple) -> dict[str, dict]:
    """Presets: each backbone size of `BACKBONE_SIZES` with the variant's own fields, given as
    `field=(tiny, small, base)`."""
    return {
        size: {**backbone, **{field: values[i] for field, values in fields.items()}}
        for i, (size, backbone) in enumerate(BACKBONE_SIZES.items())
    }


class PresetConfig:
    """Named sizes of a config class (`presets`: size -> fields), for every zoo model, decoder or translator."""

    presets: ClassVar[dict[str, dict]] = {}

    @classmethod
    def preset(cls, size: str) -> dict:
        """The config fields of preset `size` (a copy, to be updated freely)."""
        if size not in cls.presets:
            raise ValueError(
                f"size={size!r} is not a preset of {cls.model_type}; choose one of {sorted(cls.presets)}."
            )
        return dict(cls.presets[size])


class ZooConfig(PresetConfig, ZooConfigBase):  # transformers' PreTrainedConfig (a fallback before 5.4: compat_zoo)
    r"""
    Base configuration of the zoo decoder backbone: a pre-norm transformer whose attention is chosen by the variant.

    Args:
        vocab_size (`int`): number of tokens of the embedding and of the output head.
        hidden_size (`int`): width `d` of the residual stream.
        intermediate_size (`int`, *optional*): inner width of the MLP; defaults to 4 * hidden_size for the plain MLP
            and to 8/3 * hidden_size rounded up to a multiple of 64 for the gated one (same parameter count).
        num_hidden_layers (`int`): number of decoder layers `L`.
        num_attention_heads (`int`): number of query heads `H`.
        num_key_value_heads (`int`, *optional*): number of key/value heads `G` (variant-specific default).
        head_dim (`int`, *optional*): width of a head; defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`): activation of the MLP (any key of `transformers.activations.ACT2FN`).
        mlp_type (`str`): `"gated"` is `down(act(gate(x)) * up(x))` (SwiGLU with `hidden_act="silu"`, as Llama);
            `"plain"` is `down(act(up(x)))` (GPT-2 with `hidden_act="gelu_new"`); `"none"` leaves the MLP out, each
            layer then `x + attn(norm(x))` alone (Mamba's blocks, whose mixer has its own expansion and gate).
        norm_type (`str`): `"rmsnorm"` (Llama) or `"layernorm"` (GPT-2, with bias).
        norm_position (`str`): `"pre"` normalises each branch's input, `x + f(norm(x))` (GPT-2, Llama: the stream
            grows with depth and training); `"post"` normalises after each residual addition, `norm(x + f(x))`
            (Vaswani et al. 2017, Marian, BART: the stream stays at RMS 1, so a branch's write keeps its share of
            it). The model's final norm stays in both (on a post-norm stream it only applies its gain).
        max_position_embeddings (`int`): longest sequence the model is built for (size of `learned` positions).
        position_embedding_type (`str`): one of `rope` (rotary, Su et al. 2021), `alibi` (linear biases, Press et al.
            2022), `sinusoidal` (Vaswani et al. 2017), `learned` (GPT-2) or `none` (NoPE: the causal mask alone).
        rope_parameters (`dict`, *optional*): transformers' RoPE parameters; `rope_theta=` is accepted too. Only
            for `position_embedding_type="rope"`: other position types have none (`None`), and RoPE settings given
            to them are an error rather than silently ignored.
        scale_embedding (`bool`, *optional*): multiply the token embeddings by sqrt(hidden_size), which then start
            at std 1/sqrt(hidden_size) (Vaswani et al. 2017 with fairseq's and tensor2tensor's init: tokens enter at
            RMS 1). Off by default, with every position type: the rest of the model is initialised at std
            `initializer_range` (GPT-2), and a residual stream of RMS 1 left its layers' outputs 1% of it.
        embed_init_std (`float`, *optional*): the scaled token embeddings' initial std instead of 1/sqrt(hidden_size)
            (only with `scale_embedding`; unscaled ones start at `initializer_range`). Marian's is 0.02: tokens enter
            at RMS 0.02·sqrt(d), and a post-norm encoder-decoder read its source only so (docs/translation.md).
        sinusoid_amplitude (`float`, *optional*): amplitude of `sinusoidal` positions. Defaults to 1 beside scaled
            token embeddings (Vaswani et al.: both at RMS about 1) and to `initializer_range * sqrt(2) / 4` beside
            unscaled ones: positions at a quarter of the token embeddings' RMS (docs/studies/quality.md measures 1,
            the tokens' RMS and a quarter of it).
        initializer_range (`float`): standard deviation of the normal initialisation.
        scale_residual_init (`bool`, *optional*): GPT-2's scaled init, std / sqrt(2L) for the projections that write
            into the residual stream (`o_proj`, `down_proj`). Defaults to True with pre-norm, where it keeps the
            stream's variance from growing with depth, and to False with post-norm, where the stream is normalised
            after every branch and the scaling only shrinks each branch against it: a post-norm encoder-decoder
            with it did not learn to read its source (docs/translation.md, "Does the Transformer read its source?").
        rms_norm_eps (`float`): epsilon of RMSNorm.
        layer_norm_eps (`float`): epsilon of LayerNorm.
        attention_bias (`bool`): bias on the q/k/v/o projections.
        mlp_bias (`bool`): bias on the MLP projections.
        attention_dropout (`float`): dropout on the attention probabilities.
        hidden_dropout (`float`): dropout on the embeddings and on each residual branch.
        tie_word_embeddings (`bool`): share the input embedding with the output head.
        fuse_linear_cross_entropy (`bool`): opt-in, as Liger's kernels are: in training with labels, compute the head
            and the loss together in chunks, never holding the `(tokens, vocab)` logits (less memory and time for
            large vocabularies; `logits` is then None, with a one-time warning). Off by default, so that a forward
            with labels returns logits in training as every transformers causal LM does.

    Sequence to sequence (one config class serves both shapes, as BART's does):
        is_encoder_decoder (`bool`): build the encoder-decoder (`AutoModelForSeq2SeqLM` gives
            `Zoo<Variant>ForConditionalGeneration`): an encoder of the variant's bidirectional form, a decoder of its
            causal form with cross-attention. False (the default) is the decoder-only language model.
        encoder_layers, decoder_layers (`int`, *optional*): layers of the encoder and of the decoder; default
            `num_hidden_layers`.
        decoder_start_token_id (`int`, *optional*): the first decoder input, before any target token (labels are
            shifted right behind it).
        is_decoder (`bool`): True (the default: a zoo model is a decoder) builds the causal form; False the
            variant's bidirectional form, an encoder, as transformers' `EncoderDecoderModel` asks of the model it
            puts under a decoder (`from_encoder_decoder_pretrained` sets it so).
        add_cross_attention (`bool`): every decoder layer also attends to `encoder_hidden_states`, another model's
            encoder outputs (a decoder under `EncoderDecoderModel`).
        cross_attention (`str`): the cross-attention's score: `"dot"` (scaled dot product, `num_attention_heads`
            query heads sharing `cross_attention_num_key_value_heads` key/value heads: MHA, GQA or MQA) or
            `"additive"` (Bahdanau's `v·tanh(W_q q + W_k k)` per head, `cross_attention_additive_dim` wide).
        cross_attention_num_key_value_heads (`int`, *optional*): key/value heads of the cross-attention; default
            `num_attention_heads`.
        cross_attention_additive_dim (`int`, *optional*): width of the additive cross-attention's tanh layer; default
            `head_dim`.
        encoder_num_key_value_heads (`int`, *optional*): key/value heads of the encoder's self-attention, where they
            differ from the decoder's `num_key_value_heads`; default the same. Ainslie et al. 2023 uptrain T5 to
            GQA in the decoder's self- and cross-attention and keep the encoder multi-head: `num_key_value_heads=G`,
            `cross_attention_num_key_value_heads=G`, `encoder_num_key_value_heads=H`.
    """

    model_type = "zoo"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # what the Trainer drops from outputs before gathering logits

    # What a variant declares about itself (`hf-attn-zoo list`, model cards and `ZooVariant` read these).
    supported_position_types: ClassVar[tuple[str, ...]] = POSITION_EMBEDDING_TYPES
    cache_per_token: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    arxiv: ClassVar[tuple[str, ...]] = ()  # the paper's arXiv ids, for the Hub's paper links
    presets: ClassVar[dict[str, dict]] = sized()
    # weights with one entry per position (Linformer's E and F, AFT's pairwise bias), which no input may outgrow
    # whatever its position type; "" where nothing but the position type depends on max_position_embeddings
    position_table: ClassVar[str] = ""

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int | None = None
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    mlp_type: str = "gated"
    norm_type: str = "rmsnorm"
    norm_position: str = "pre"
    max_position_embeddings: int = 2048
    position_embedding_type: str = "rope"
    rope_parameters: dict | None = None
    scale_embedding: bool | None = None
    sinusoid_amplitude: float | None = None
    embed_init_std: float | None = None
    initializer_range: float = 0.02
    scale_residual_init: bool | None = None
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    fuse_linear_cross_entropy: bool = False
    encoder_layers: int | None = None
    decoder_layers: int | None = None
    decoder_start_token_id: int | None = None
    is_encoder_decoder: bool = False
    is_decoder: bool = True
    add_cross_attention: bool = False
    cross_attention: str = "dot"
    cross_attention_num_key_value_heads: int | None = None
    cross_attention_additive_dim: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None and _is_positive_int(self.hidden_size):
            self.intermediate_size = default_intermediate_size(self.hidden_size, self.mlp_type)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and _is_positive_int(self.num_attention_heads) and _is_positive_int(self.hidden_size):
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}: pick a head count that divides it, or set head_dim explicitly "
                    f"(the attention width is then num_attention_heads * head_dim)."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.is_encoder_decoder:
            self.encoder_layers = self.num_hidden_layers if self.encoder_layers is None else self.encoder_layers
            self.decoder_layers = self.num_hidden_layers if self.decoder_layers is None else self.decoder_layers
        if self.cross_attention_num_key_value_heads is None:
            self.cross_attention_num_key_value_heads = self.num_attention_heads
        if self.cross_attention_additive_dim is None:
            self.cross_attention_additive_dim = self.head_dim
        # saved explicitly, so that a checkpoint computes what it was trained as whatever later defaults become
        self.scale_embedding = bool(self.scale_embedding)
        if self.scale_residual_init is None:
            self.scale_residual_init = self.norm_position != "post"
        if self.sinusoid_amplitude is None and self.position_embedding_type == "sinusoidal":
            # beside unscaled tokens, at a quarter of their RMS: at their full RMS the fixed signal still cost a
            # 4 x 128 model 34% of perplexity after 100 steps, at a quarter 2% (docs/studies/quality.md)
            self.sinusoid_amplitude = 1.0 if self.scale_embedding else self.initializer_range * math.sqrt(2) / 4
        super().__post_init__(**kwargs)
        self.validate()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' `from_dict`, reading a sinusoidal checkpoint saved before `sinusoid_amplitude` existed
        (its `scale_embedding` null) as the model it was: tokens scaled by sqrt(d), sinusoids of amplitude 1."""
        if (
            config_dict.get("position_embedding_type") == "sinusoidal"
            and "sinusoid_amplitude" not in config_dict
            and config_dict.get("scale_embedding") is None
        ):
            config_dict = {**config_dict, "scale_embedding": True, "sinusoid_amplitude": 1.0}
        return super().from_dict(config_dict, **kwargs)

    @property
    def variant_name(self) -> str:
        """The registry name of the variant (`gqa` for `zoo_gqa`)."""
        return self.model_type.removeprefix("zoo_")

    def validate(self) -> None:
        """Run transformers' own checks, then the zoo's; raises `ValueError` naming the field and the fix."""
        super().validate()
        self._check_backbone()
        self._check_cross_attention()
        self._check_variant()

    def _check_backbone(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            divisors = [g for g in range(1, self.num_attention_heads + 1) if self.num_attention_heads % g == 0]
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide num_attention_heads="
                f"{self.num_attention_heads}: query head h reads key/value head h // (num_attention_heads / "
                f"num_key_value_heads), so set num_key_value_heads to one of {divisors}."
            )
        check_choice(
            "position_embedding_type",
            self.position_embedding_type,
            self.supported_position_types,
            f"{type(self).__name__} ({self.model_type})",
        )
        check_choice("norm_type", self.norm_type, NORM_TYPES)
        check_choice("norm_position", self.norm_position, NORM_POSITIONS)
        check_choice("mlp_type", self.mlp_type, MLP_TYPES)
        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not a known activation; use one of transformers' ACT2FN keys, "
                f"e.g. 'silu', 'gelu', 'gelu_new', 'relu'."
            )
        self._check_rope_parameters()
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim={self.head_dim} must be even for position_embedding_type='rope' (RoPE rotates pairs of "
                f"channels); choose an even head_dim or another position_embedding_type."
            )
        if self.position_embedding_type == "sinusoidal" and self.hidden_size % 2 != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be even for position_embedding_type='sinusoidal' (sine and "
                f"cosine channels come in pairs)."
            )
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}.")
        for name in ("initializer_range", "rms_norm_eps", "layer_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        if self.embed_init_std is not None:
            if not isinstance(self.embed_init_std, (int, float)) or self.embed_init_std <= 0:
                raise ValueError(f"embed_init_std must be a positive number (or unset), got {self.embed_init_std!r}.")
            if not self.scale_embedding:
                raise ValueError(
                    f"embed_init_std={self.embed_init_std} sets the init of scaled token embeddings: set "
                    f"scale_embedding=True, or leave it unset (unscaled tokens start at initializer_range="
                    f"{self.initializer_range})."
                )

    @property
    def has_cross_attention(self) -> bool:
        """Whether decoder layers of this config attend to an encoder (their own encoder, or another model's)."""
        return bool(self.is_encoder_decoder or self.add_cross_attention)

    def _check_cross_attention(self) -> None:
        for name in ("encoder_layers", "decoder_layers"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive integer (or unset: num_hidden_layers), got {value!r}.")
        check_choice("cross_attention", self.cross_attention, CROSS_ATTENTIONS)
        heads = self.cross_attention_num_key_value_heads
        if not _is_positive_int(heads) or self.num_attention_heads % heads != 0:
            divisors = [g for g in range(1, self.num_attention_heads + 1) if self.num_attention_heads % g == 0]
            raise ValueError(
                f"cross_attention_num_key_value_heads={heads!r} must divide num_attention_heads="
                f"{self.num_attention_heads} (query head h reads cross-attention key/value head h // (H / G)); use "
                f"one of {divisors}."
            )
        encoder_heads = self.encoder_num_key_value_heads
        if encoder_heads is not None and (
            not _is_positive_int(encoder_heads) or self.num_attention_heads % encoder_heads != 0
        ):
            raise ValueError(
                f"encoder_num_key_value_heads={encoder_heads!r} must divide num_attention_heads="
                f"{self.num_attention_heads} (or be unset: the decoder's num_key_value_heads)."
            )
        if not _is_positive_int(self.cross_attention_additive_dim):
            raise ValueError(
                f"cross_attention_additive_dim must be a positive integer (the width of the additive "
                f"cross-attention's tanh layer), got {self.cross_attention_additive_dim!r}."
            )
        start = self.decoder_start_token_id
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise ValueError(f"decoder_start_token_id must be a token id (an integer >= 0), got {start!r}.")
        if start is not None and start >= self.vocab_size:
            raise ValueError(
                f"decoder_start_token_id={start} is not a token of the vocabulary (vocab_size={self.vocab_size})."
            )

    def _check_rope_parameters(self) -> None:
        """RoPE parameters belong to RoPE configurations only. transformers gives every config that declares the
        field the default `{"rope_type": "default", "rope_theta": ...}`; a non-RoPE configuration drops that default
        (checkpoints saved before carried it) and refuses anything else, which would do nothing."""
        default = {"rope_type": "default", "rope_theta": self.default_theta}
        if self.position_embedding_type == "rope":
            if self.rope_parameters is None:  # switched to RoPE after construction
                self.rope_parameters = default
            return
        if self.rope_parameters and self.rope_parameters != default:
            raise ValueError(
                f"rope_parameters={self.rope_parameters} only apply to position_embedding_type='rope', but this "
                f"config uses position_embedding_type={self.position_embedding_type!r}, where they would change "
                f"nothing; remove rope_parameters (and rope_theta / rope_scaling), or use position_embedding_type="
                f"'rope' where the variant supports it."
            )
        self.rope_parameters = None

    def check_position_table(self, last_position: int) -> None:
        """ValueError naming `position_table` where a token at `last_position` lies past it."""
        if last_position >= self.max_position_embeddings:
            raise ValueError(
                f"position {last_position} is beyond max_position_embeddings={self.max_position_embeddings}, the "
                f"size of {self.position_table}; shorten the input or build the model with a larger "
                f"max_position_embeddings."
            )

    def _check_variant(self) -> None:
        """Variant-specific checks; subclasses override."""


class ZooChunkedConfig(ZooConfig):
    """Base of the variants whose kernels walk over the sequence in chunks (top-k, additive, Linformer, AFT).

    Args:
        query_chunk_size (`int`): queries (or tokens) processed at once: peak memory is proportional to it.
    """

    query_chunk_size: int = 64

    def _check_variant(self) -> None:
        if not _is_positive_int(self.query_chunk_size):
            raise ValueError(f"query_chunk_size must be a positive integer, got {self.query_chunk_size!r}.")


def check_positive_int(config: ZooConfig, field: str, meaning: str, at_most: str | None = None) -> None:
    """Raise `ValueError` naming `field` unless it is an integer >= 1 (and <= the config field `at_most`)."""
    value = getattr(config, field)
    if not _is_positive_int(value):
        raise ValueError(f"{field}={value!r} must be a positive integer: {meaning}.")
    if at_most is not None and value > getattr(config, at_most):
        raise ValueError(
            f"{field}={value} is larger than {at_most}={getattr(config, at_most)}: {meaning}; lower {field} or raise "
            f"{at_most}."
        )


def default_intermediate_size(hidden_size: int, mlp_type: str) -> int:
    if mlp_type == "gated":
        return 64 * math.ceil(8 * hidden_size / 3 / 64)
    return 4 * hidden_size


def is_int(value) -> bool:
    """An integer that is not a bool (a config field's `True` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value) -> bool:
    return is_int(value) and value > 0


def check_choice(field: str, value, choices: tuple[str, ...], owner: str | None = None) -> None:
    if value not in choices:
        where = f" by {owner}" if owner else ""
        raise ValueError(f"{field}={value!r} is not supported{where}; use one of {list(choices)}.")
