"""Any zoo attention from an MHA-family parent, then attention transfer: each converted layer learns to reproduce the
parent layer's attention output (LoLCATs' first stage, Zhang et al. 2024).

`convert_attention(parent, to=variant, **fields)` builds the target from a Llama-family or zoo MHA-family parent:

- `mha`, `gqa`, `mqa`: key/value heads pooled by `mha_to_gqa` (Ainslie et al. 2023; the calibrated methods too);
- `mla`: a latent computed from the parent's projections by `to_mla` (TransMLA / MHA2MLA);
- every other variant: the parent's config (the head fields its attention class keeps, `parent_head_fields`) with
  `fields` on top, everything outside the attention copied, and inside it the projections the attention class
  declares in `parent_weights` taken from the parent where the shapes allow (key/value rows repeated or mean-pooled
  to the target's key/value heads, as transformers' `repeat_kv` groups them); the rest fresh. Positions the target
  cannot read (RoPE for additive and AFT) become its default, which adds nothing to the residual stream (ALiBi or
  none); positions that would (sinusoidal, learned) are refused unless the parent has them, since the parent's
  layers never saw them.

`attention_transfer(parent, student, batches)` then trains the student's attention layers one at a time, in a
single pass from the first layer to the last: the parent runs layer by layer over the calibration batches, and only
the hidden states entering the current layer are kept, with the parent's attention inputs and outputs in that layer
(memory: three of one layer's activations for the calibration tokens). For layer l the loss is the mean squared
error between the student's attention output and the parent's, both on the parent's normalised hidden states entering
layer l, and only layer l's attention parameters are trained (Adam). The student's other weights are the parent's own
copies and stay as they are.

`seq2seq_attention_transfer(parent, student, pairs)` does the same for an encoder-decoder whose decoder was converted
(`seq2seq_mha_to_gqa`): per decoder layer, its self-attention and then its cross-attention, on the parent's stream
teacher-forced over sentence pairs, the encoder's outputs the parent's.
"""

import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from ..models import ZooForCausalLM, get_variant
from ..models.translator_zoo import shift_tokens_right
from .calibrated import calibration_batches
from .latent import MLA_METHODS, to_mla
from .llama import from_llama, in_mha_family
from .pooling import METHODS, mha_to_gqa, pool_heads

# positions that add nothing to the residual stream: the parent's hidden states stay what the student's layers read
RESIDUAL_FREE_POSITIONS = ("rope", "alibi", "none")
# config entries that describe the saved model rather than its shape
NOT_INHERITED = ("architectures", "model_type", "auto_map", "transformers_version", "dtype", "torch_dtype")


@dataclass(frozen=True)
class Conversion:
    """A converted model and how its attention was initialised. `copied`: the attention parameters (names within a
    layer's `self_attn`) taken from the parent, adapted to their shape; `fresh`: those initialised afresh; `how`: in
    words, for a model card or a summary."""

    model: ZooForCausalLM
    copied: tuple[str, ...]
    fresh: tuple[str, ...]
    how: str
    fields: dict = field(default_factory=dict)  # the target's config fields that differ from the parent's


def adapt_rows(tensor: torch.Tensor, shape: torch.Size, heads: int) -> torch.Tensor | None:
    """The parent's key or value projection rows (`(heads * d, ...)`, or a bias) at the target's `shape`: each head
    repeated where the target has a multiple of the parent's heads, contiguous groups mean-pooled where it has a
    divisor of them; None where neither fits."""
    if tensor.shape[1:] != shape[1:] or tensor.shape[0] % heads:
        return None
    width = tensor.shape[0] // heads
    if shape[0] % width:
        return None
    target_heads = shape[0] // width
    if target_heads % heads == 0:
        # (heads * d, ...) -> (heads, d, ...) -> each head r times, contiguous as repeat_kv reads them
        per_head = tensor.reshape(heads, width, *tensor.shape[1:])
        return per_head.repeat_interleave(target_heads // heads, dim=0).reshape(shape).clone()
    if heads % target_heads == 0:
        return pool_heads(tensor, heads, target_heads, "mean")
    return None


def parent_tensor(name: str, tensor: torch.Tensor, shape: torch.Size, heads: int) -> torch.Tensor | None:
    """The parent's attention tensor `name` (within `self_attn`) at the target's `shape`, or None where it does not
    fit: copied as it is at the same shape, key/value rows adapted to the target's heads (`adapt_rows`)."""
    if tensor.shape == shape:
        return tensor.clone()
    if name.split(".")[0] in ("k_proj", "v_proj"):
        return adapt_rows(tensor, shape, heads)
    return None


def zoo_parent(parent) -> ZooForCausalLM:
    """The parent as a zoo MHA-family model (a Llama / Mistral / Qwen2 model is converted first); refused otherwise."""
    if not isinstance(parent, ZooForCausalLM):
        try:
            parent = from_llama(parent)
        except ValueError as error:
            raise ValueError(f"the parent cannot be read as an MHA-family model: {error}") from error
    if not in_mha_family(parent.config.model_type):
        raise ValueError(
            f"the parent is {parent.config.model_type}, not an MHA-family model (Llama, Mistral, Qwen2, or zoo mha, "
            f"gqa, mqa): conversions start from the query, key, value and output projections of softmax attention."
        )
    return parent


def target_fields(parent: ZooForCausalLM, variant, fields: dict) -> dict:
    """The target's config fields: the parent's that its config class takes (the head fields only where its
    attention keeps heads), positions it can read, then `fields`."""
    attention = variant.attention_class
    config = parent.config
    dropped = {"num_attention_heads", "num_key_value_heads", "head_dim"} - set(attention.parent_head_fields)
    inherited = {
        key: value
        for key, value in config.to_dict().items()
        if key in variant.config_class.__dataclass_fields__
        and key not in NOT_INHERITED
        and key not in dropped
        and not key.startswith(("cross_attention", "encoder_"))  # a decoder-only parent's: the target's defaults
    }
    positions = fields.get("position_embedding_type", config.position_embedding_type)
    if positions not in variant.position_types and "position_embedding_type" not in fields:
        default = variant.config_class.__dataclass_fields__["position_embedding_type"].default
        positions = default if default in variant.position_types and default in RESIDUAL_FREE_POSITIONS else "none"
    if positions != config.position_embedding_type and positions not in RESIDUAL_FREE_POSITIONS:
        raise ValueError(
            f"position_embedding_type={positions!r} adds positions to the residual stream, which the parent's "
            f"{config.position_embedding_type!r} model never saw; use one of {RESIDUAL_FREE_POSITIONS} that "
            f"{variant.name} supports ({', '.join(variant.position_types)})."
        )
    inherited["position_embedding_type"] = positions
    if positions != "rope":
        inherited.pop("rope_parameters", None)  # only RoPE reads them (the config refuses them otherwise)
    return {**inherited, **fields}


def convert_attention(
    parent,
    to: str,
    method: str | None = None,
    calibration=None,
    tokenizer=None,
    max_calibration_tokens: int | None = None,
    **fields,
) -> Conversion:
    """The zoo `to` variant of `parent` (a Llama-family model or a zoo MHA-family model), its attention initialised
    from the parent's (module docstring); `fields` set the target's config fields (`num_key_value_heads` for gqa,
    `kv_lora_rank` and `qk_rope_head_dim` for mla, `sliding_window`, `linformer_k`, `topk`, `additive_dim` ...).
    `method`, `calibration`, `tokenizer` and `max_calibration_tokens` are those of `mha_to_gqa` and `to_mla`. A
    target that cannot be built from the parent raises `ValueError` naming the field and the fix."""
    parent = zoo_parent(parent)
    config = parent.config
    variant = get_variant(to)
    calibrated = {"calibration": calibration, "tokenizer": tokenizer, "max_calibration_tokens": max_calibration_tokens}
    if in_mha_family(variant.name):
        if variant.name == "gqa" and "num_key_value_heads" not in fields:
            raise ValueError(f"to='gqa' needs num_key_value_heads (a divisor of {config.num_key_value_heads}).")
        # mha and mqa: the count their config class fixes at the parent's query heads
        shape = {name: getattr(config, name) for name in ("hidden_size", "num_attention_heads", "head_dim")}
        groups = fields.pop("num_key_value_heads", None) or variant.config(**shape).num_key_value_heads
        if fields:
            raise ValueError(f"{sorted(fields)}: {to} keeps every other field of the parent; set num_key_value_heads.")
        if isinstance(groups, int) and groups > config.num_key_value_heads and method is None and calibration is None:
            # more key/value heads than the parent's: each repeated, as repeat_kv reads it (the same function)
            fields = {"num_key_value_heads": groups}
            return copied_conversion(parent, variant, fields, ("q_proj", "k_proj", "v_proj", "o_proj"))
        model = mha_to_gqa(parent, groups, method or "mean", **calibrated)
        names = tuple(name for name, _ in model.model.layers[0].self_attn.named_parameters())
        pooled = f"{config.num_key_value_heads} -> {groups} key/value heads, {method or 'mean'}-pooled"
        return Conversion(model, names, (), pooled, {"num_key_value_heads": groups})
    if variant.attention_class.parent_weights is None:  # MLA: computed from the parent by to_mla
        if "kv_lora_rank" not in fields:
            raise ValueError(
                "to='mla' needs kv_lora_rank: the latent's width (the cache keeps kv_lora_rank + qk_rope_head_dim)."
            )
        rank, rope = fields.pop("kv_lora_rank"), fields.pop("qk_rope_head_dim", None)
        if fields:
            raise ValueError(f"{sorted(fields)}: to='mla' takes kv_lora_rank and qk_rope_head_dim.")
        if method is not None and method not in MLA_METHODS:
            raise ValueError(f"method={method!r} does not apply to mla; use one of {MLA_METHODS}.")
        model = to_mla(parent, rank, rope, method or "rorope", **calibrated)
        names = tuple(name for name, _ in model.model.layers[0].self_attn.named_parameters())
        how = f"a latent of {rank} and a shared RoPE key of {model.config.qk_rope_head_dim} ({method or 'rorope'})"
        return Conversion(
            model, names, (), how, {"kv_lora_rank": rank, "qk_rope_head_dim": model.config.qk_rope_head_dim}
        )
    if not variant.attention_class.parent_weights:
        raise ValueError(
            f"to={to!r}: no weight of an attention layer means anything in {variant.name}'s "
            f"{variant.attention_class.family} mixer (parent_weights is empty), so nothing of the parent's attention "
            f"can start it; train {variant.name} from scratch (hf-attn-zoo train) or convert to a variant that reads "
            f"queries, keys and values."
        )
    if method is not None or calibration is not None:
        raise ValueError(
            f"method and calibration choose how {METHODS} pool heads or {MLA_METHODS} fit a latent; {to} copies "
            f"the parent's projections and takes neither."
        )
    return copied_conversion(parent, variant, fields, variant.attention_class.parent_weights)


def copied_conversion(parent: ZooForCausalLM, variant, fields: dict, takes: tuple[str, ...]) -> Conversion:
    """`variant` built on the parent's config with `fields` on top: everything outside the attention copied, the
    attention's projections named in `takes` taken from the parent where the shapes allow, the rest fresh."""
    config, to = parent.config, variant.name
    new_config = variant.config(**target_fields(parent, variant, fields))
    backend = config._attn_implementation
    new_config._attn_implementation = backend if backend in variant.backends else variant.default_backend
    model = variant.causal_lm_class(new_config)
    state, parent_state = model.state_dict(), parent.state_dict()
    copied, fresh = [], []
    for name, tensor in state.items():
        if ".self_attn." not in name:
            source = parent_state.get(name)
            if source is None or source.shape != tensor.shape:
                raise ValueError(
                    f"{name} of {to} has shape {tuple(tensor.shape)}, the parent's "
                    f"{None if source is None else tuple(source.shape)}: the conversion replaces attention only, so "
                    f"leave the backbone's fields (hidden_size, intermediate_size, num_hidden_layers, vocab_size, "
                    f"norms, MLP) as the parent's."
                )
            state[name] = source
            continue
        inner = name.split(".self_attn.")[1]
        taken = None
        if inner.split(".")[0] in takes and name in parent_state:
            taken = parent_tensor(inner, parent_state[name], tensor.shape, config.num_key_value_heads)
        if taken is not None:
            state[name] = taken
        if name.startswith("model.layers.0."):
            (copied if taken is not None else fresh).append(inner)
    model.load_state_dict(state, strict=True)
    model = model.to(parent.dtype).train(parent.training)
    changed = {key: value for key, value in new_config.to_dict().items() if getattr(config, key, None) != value}
    changed = {key: value for key, value in changed.items() if key in fields or key == "position_embedding_type"}
    how = f"copied {', '.join(copied) or 'nothing'}; fresh {', '.join(fresh) or 'nothing'}"
    return Conversion(model, tuple(copied), tuple(fresh), how, changed)


@dataclass
class LayerTransfer:
    """One layer's attention transfer: the mean squared error against the parent's attention output over the
    calibration batches before and after training, each also relative to the mean square of the parent's output
    (0: reproduced exactly, 1: no better than zeros). A layer whose loss training did not lower keeps its initial
    weights (`kept_initial`), so the transfer never leaves a layer further from its parent on the calibration text."""

    layer: int
    loss_before: float
    loss_after: float
    relative_before: float
    relative_after: float
    steps: int
    seconds: float
    kept_initial: bool = False  # training did not lower the loss, so the layer keeps its initial weights
    module: str = "self_attn"  # the attention trained: a layer's self-attention, or a decoder's encoder_attn


class StopAtFirstLayer(Exception):
    """Raised by the hook that catches what the backbone hands its first layer."""


def first_layer_inputs(model: ZooForCausalLM, input_ids: torch.LongTensor) -> tuple[torch.Tensor, dict]:
    """(hidden states, keyword arguments) the backbone hands its first decoder layer for `input_ids` (no cache): the
    embeddings with absolute positions added, and the mask and RoPE tables of the model's own attention. Caught by a
    hook that stops the forward there, so no layer runs."""
    return stack_inputs(model.model, input_ids=input_ids.to(model.device), use_cache=False)


def stack_inputs(stack: torch.nn.Module, **inputs) -> tuple[torch.Tensor, dict]:
    """(hidden states, keyword arguments) `stack` (a backbone, or an encoder-decoder's decoder) hands its first layer
    when called with `inputs`, caught by a hook that stops the forward there."""
    caught = {}

    def catch(module, args, kwargs):
        # the backbone passes the tensors that carry gradients positionally (gradient checkpointing needs them so):
        # named by the layer's own signature, whichever way they came
        arguments = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
        caught["hidden_states"] = arguments.pop("hidden_states")
        caught["kwargs"] = {**arguments, **arguments.pop("kwargs", {})}
        raise StopAtFirstLayer

    handle = stack.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        stack(**inputs)
    except StopAtFirstLayer:
        pass
    finally:
        handle.remove()
    return caught["hidden_states"], caught["kwargs"]


def attention_kwargs(layer_kwargs: dict) -> dict:
    """What a decoder layer passes on to its self-attention (the cross-attention's inputs stay with the layer; no
    cache: transfer runs whole rows)."""
    layer_only = ("encoder_hidden_states", "cross_attention_mask", "cross_cache", "cache")
    return {key: value for key, value in layer_kwargs.items() if key not in layer_only}


def attention_transfer(
    parent,
    student: ZooForCausalLM,
    batches: Sequence[torch.LongTensor],
    epochs: int = 1,
    learning_rate: float = 1e-3,
    layers: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
    done: Mapping[int, LayerTransfer] | None = None,
    on_layer: Callable[[torch.nn.Module, LayerTransfer], None] | None = None,
) -> list[LayerTransfer]:
    """Train each of `student`'s attention layers (all, or those in `layers`) to reproduce `parent`'s attention
    output on the calibration `batches` (`(B, T)` token ids), in place (module docstring): `epochs` passes over the
    batches per layer, Adam at `learning_rate`, no weight decay (a layer that already reproduces its parent stays
    as it is). `progress` is called with the number of steps just taken, `on_layer` with each layer's attention
    and result once trained. Layers in `done` (index -> result) were transferred before, their weights already in
    `student`: skipped, their results returned as they are. Each layer learns from the parent's hidden states, never
    the student's, so a layer's transfer is the same whichever others are done. Returns one `LayerTransfer` per
    layer."""
    parent = zoo_parent(parent)
    if parent.config.num_hidden_layers != student.config.num_hidden_layers:
        raise ValueError(
            f"the student has {student.config.num_hidden_layers} layers, the parent {parent.config.num_hidden_layers}"
            f": transfer pairs each converted layer with the parent layer it replaces."
        )
    if not batches:
        raise ValueError("no calibration batches: attention transfer needs text to reproduce the parent on.")
    chosen = set(range(student.config.num_hidden_layers) if layers is None else layers)
    if not chosen or not chosen <= set(range(student.config.num_hidden_layers)):
        raise ValueError(f"layers={layers!r} must name layers from 0 to {student.config.num_hidden_layers - 1}.")
    last = max(chosen)
    parent_training, student_training = parent.training, student.training
    parent.eval(), student.eval()  # no dropout: the targets and the student see the same function every step
    results = []
    try:
        with torch.no_grad():
            inputs = [first_layer_inputs(parent, batch) for batch in batches]
            hidden = [states for states, _ in inputs]  # the parent's hidden states entering the current layer
            parent_kwargs = [kwargs for _, kwargs in inputs]
            student_kwargs = [attention_kwargs(first_layer_inputs(student, batch)[1]) for batch in batches]
        for index, (parent_layer, student_layer) in enumerate(zip(parent.model.layers, student.model.layers)):
            if index in chosen and index in (done or {}):
                results.append(done[index])
            elif index in chosen:
                result = transfer_layer(
                    index,
                    parent_layer,
                    student_layer.self_attn,
                    hidden,
                    parent_kwargs,
                    student_kwargs,
                    epochs,
                    learning_rate,
                    progress,
                )
                results.append(result)
                if on_layer is not None:
                    on_layer(student_layer.self_attn, result)
            if index == last:
                break  # the parent's later layers are not needed
            with torch.no_grad():
                hidden = [parent_layer(states, **kwargs) for states, kwargs in zip(hidden, parent_kwargs)]
    finally:
        parent.train(parent_training), student.train(student_training)
    return results


def transfer_layer(
    index: int,
    parent_layer: torch.nn.Module,
    attention: torch.nn.Module,
    hidden: list[torch.Tensor],
    parent_kwargs: list[dict],
    student_kwargs: list[dict],
    epochs: int,
    learning_rate: float,
    progress: Callable[[int], None] | None,
) -> LayerTransfer:
    """Train one student self-`attention` on the parent's: inputs and targets come from `parent_layer` on `hidden`."""

    def pair(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self_attention_io(parent_layer, hidden[batch], parent_kwargs[batch])

    def student(batch: int, normed: torch.Tensor) -> torch.Tensor:
        return attention(hidden_states=normed, **student_kwargs[batch])[0]

    return transfer_module(index, "self_attn", attention, pair, student, len(hidden), epochs, learning_rate, progress)


def transfer_module(
    index: int,
    module: str,
    attention: torch.nn.Module,
    pair: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    student: Callable[[int, torch.Tensor], torch.Tensor],
    batches: int,
    epochs: int,
    learning_rate: float,
    progress: Callable[[int], None] | None,
) -> LayerTransfer:
    """Train the student's `attention` (its parameters alone, Adam) so that `student(batch, input)` reproduces the
    parent's output, `pair(batch)` -> (the input both read, the parent's output; computed without gradients), over
    `batches` batches `epochs` times; measured before and after, the initial weights kept where training did not
    lower the loss."""
    start = time.perf_counter()
    with torch.no_grad():
        # the parent is frozen: its pairs are computed once and read by both measurements and every epoch (a third
        # of the transfer's time when recomputed; memory: two more tensors of the layer's stream)
        targets = [pair(batch) for batch in range(batches)]

    def measure() -> tuple[float, float]:
        loss, power = 0.0, 0.0
        with torch.no_grad():
            for batch in range(batches):
                normed, wanted = targets[batch]
                loss += F.mse_loss(student(batch, normed).float(), wanted.float()).item()
                power += wanted.float().square().mean().item()
        return loss / batches, loss / max(power, 1e-30)

    before, relative_before = measure()
    initial = {name: tensor.clone() for name, tensor in attention.state_dict().items()}
    parameters = [parameter for parameter in attention.parameters() if parameter.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=learning_rate)
    steps = 0
    for _ in range(epochs):
        for batch in range(batches):
            normed, wanted = targets[batch]
            loss = F.mse_loss(student(batch, normed).float(), wanted.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if progress is not None:
                progress(1)
    optimizer.zero_grad(set_to_none=True)
    after, relative_after = measure()
    kept = after >= before  # training overshot (a learning rate too high for a layer that started close)
    if kept:
        attention.load_state_dict(initial)
        after, relative_after = before, relative_before
    seconds = time.perf_counter() - start
    return LayerTransfer(index, before, after, relative_before, relative_after, steps, seconds, kept, module)


def seq2seq_attention_transfer(
    parent,
    student,
    batches: Sequence[tuple[torch.LongTensor, torch.LongTensor]],
    epochs: int = 1,
    learning_rate: float = 1e-3,
    progress: Callable[[int], None] | None = None,
) -> list[LayerTransfer]:
    """Attention transfer for an encoder-decoder converted in its decoder (`seq2seq_mha_to_gqa`: the decoder's
    self- and cross-attention pooled, the encoder the parent's own): in one pass over the decoder's layers, each
    layer's self-attention, then its cross-attention (`encoder_attn`), learns to reproduce the parent's on the
    parent's own inputs to it. `batches`: `(source ids, target ids)` pairs (`(1, S)` / `(1, T)`, unpadded, as
    `train.build.first_pairs` gives them), teacher-forced (the target shifted right behind the decoder's start token
    is the decoder's input). The source is encoded once per pair by the parent's encoder, which the student's
    equals. Returns two `LayerTransfer`s a layer."""
    if not getattr(parent.config, "is_encoder_decoder", False) or not hasattr(student.model, "decoder"):
        raise ValueError(
            "seq2seq_attention_transfer pairs two encoder-decoders: use attention_transfer for a decoder."
        )
    parent_layers, student_layers = parent.model.decoder.layers, student.model.decoder.layers
    if len(parent_layers) != len(student_layers):
        raise ValueError(
            f"the student's decoder has {len(student_layers)} layers, the parent's {len(parent_layers)}: transfer "
            f"pairs each converted layer with the parent layer it replaces."
        )
    if not batches:
        raise ValueError("no calibration pairs: attention transfer needs pairs to reproduce the parent on.")
    parent_training, student_training = parent.training, student.training
    parent.eval(), student.eval()
    results = []
    try:
        with torch.no_grad():
            device = parent.device
            sources = [parent.model.encoder(input_ids=s.to(device)).last_hidden_state for s, _ in batches]
            config = parent.config
            inputs = [
                {
                    "input_ids": shift_tokens_right(
                        target.to(device), config.pad_token_id, config.decoder_start_token_id
                    ),
                    "encoder_hidden_states": source,
                    "use_cache": False,
                }
                for source, (_, target) in zip(sources, batches)
            ]
            caught = [stack_inputs(parent.model.decoder, **given) for given in inputs]
            hidden = [states for states, _ in caught]  # the parent's stream entering the current decoder layer
            parent_kwargs = [kwargs for _, kwargs in caught]
            student_kwargs = [stack_inputs(student.model.decoder, **given)[1] for given in inputs]
        for index, (parent_layer, student_layer) in enumerate(zip(parent_layers, student_layers)):
            results.append(
                transfer_layer(
                    index,
                    parent_layer,
                    student_layer.self_attn,
                    hidden,
                    parent_kwargs,
                    [attention_kwargs(kwargs) for kwargs in student_kwargs],
                    epochs,
                    learning_rate,
                    progress,
                )
            )
            with torch.no_grad():  # the stream after the parent's self-attention branch: what cross-attention reads
                middle = [
                    parent_layer._add(
                        states, self_attention_io(parent_layer, states, kwargs)[1], parent_layer.input_layernorm
                    )
                    for states, kwargs in zip(hidden, parent_kwargs)
                ]
            results.append(
                cross_transfer(
                    index, parent_layer, student_layer, middle, parent_kwargs, student_kwargs, epochs, learning_rate,
                    progress,
                )
            )  # fmt: skip
            with torch.no_grad():
                hidden = [parent_layer(states, **kwargs) for states, kwargs in zip(hidden, parent_kwargs)]
    finally:
        parent.train(parent_training), student.train(student_training)
    return results


def self_attention_io(parent_layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """(what the parent layer's self-attention reads of the stream `hidden` entering the layer, its output)."""
    normed = parent_layer.branch_input(hidden, parent_layer.input_layernorm)
    return normed, parent_layer.self_attn(hidden_states=normed, **attention_kwargs(kwargs))[0]


def cross_transfer(
    index: int,
    parent_layer: torch.nn.Module,
    student_layer: torch.nn.Module,
    middle: list[torch.Tensor],
    parent_kwargs: list[dict],
    student_kwargs: list[dict],
    epochs: int,
    learning_rate: float,
    progress: Callable[[int], None] | None,
) -> LayerTransfer:
    """Train a decoder layer's cross-attention on the parent's: both read the parent's normalised stream `middle`
    (after its self-attention branch) and the encoder's outputs, each under its own source mask."""

    def pair(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        normed = parent_layer.branch_input(middle[batch], parent_layer.encoder_attn_layer_norm)
        kwargs = parent_kwargs[batch]
        target = parent_layer.encoder_attn(normed, kwargs["encoder_hidden_states"], kwargs["cross_attention_mask"])[0]
        return normed, target

    def student(batch: int, normed: torch.Tensor) -> torch.Tensor:
        kwargs = student_kwargs[batch]
        return student_layer.encoder_attn(normed, kwargs["encoder_hidden_states"], kwargs["cross_attention_mask"])[0]

    attention = student_layer.encoder_attn
    return transfer_module(
        index, "encoder_attn", attention, pair, student, len(middle), epochs, learning_rate, progress
    )


def transfer_batches(
    texts: Sequence[str],
    tokenizer,
    block_size: int,
    max_tokens: int | None = None,
    batch_size: int = 1,
) -> list[torch.LongTensor]:
    """Calibration text as `(batch_size, block_size)` token batches, `max_tokens` in all (when given): each text
    tokenized on its own and cut into blocks of `block_size` (a shorter last block of a text is dropped when a full
    one exists, so every batch is rectangular); blocks of a batch are stacked in order."""
    blocks = [
        block for block in calibration_batches(list(texts), tokenizer, block_size, max_tokens) if block.shape[1] > 1
    ]
    if not blocks:
        return []
    full = [block for block in blocks if block.shape[1] == block_size]
    blocks = full or blocks[:1]
    return [torch.cat(blocks[start : start + batch_size]) for start in range(0, len(blocks), batch_size)]


def transfer_steps(batches: Sequence[torch.LongTensor], layers: int, epochs: int = 1) -> int:
    """How many optimiser steps `attention_transfer` takes (for a progress bar)."""
    return len(batches) * layers * epochs


def mean_relative(results: Sequence[LayerTransfer], attribute: str) -> float:
    """The mean of one `LayerTransfer` attribute over layers (NaN for none)."""
    return sum(getattr(result, attribute) for result in results) / len(results) if results else math.nan


__all__ = [
    "Conversion",
    "LayerTransfer",
    "attention_transfer",
    "convert_attention",
    "seq2seq_attention_transfer",
    "transfer_batches",
    "transfer_steps",
]
