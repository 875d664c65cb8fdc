"""Names the zoo takes from transformers that older 5.x releases lack, with a fallback where they are missing.

The package supports transformers from the floor in `pyproject.toml` up. Where a newer release added a helper the
zoo uses, this module imports it when it is there and otherwise defines the same behaviour, so the rest of the models
folder imports one name and never branches on versions. Like its siblings, it travels next to every saved checkpoint
(remote code), so it imports only torch and transformers.
"""

import copy
import functools
import inspect
import typing
from collections.abc import Callable

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

try:  # transformers >= 5.3
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers 5.0 - 5.2 sliced inline in every model (`slice(-n, None)` or the given indices)

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """Keep the positions of `hidden_states` whose logits are wanted, as transformers >= 5.3 does: an int keeps
        the last `logits_to_keep` (0 keeps all), a 1D tensor those positions for every row, a 2D integer tensor per-row
        positions, and a 2D boolean mask the `True` positions (flattened to `(num_true, hidden_size)`)."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        if isinstance(logits_to_keep, int):
            logits_to_keep = slice(-logits_to_keep, None)
        return hidden_states[:, logits_to_keep, :]


# transformers >= 5.4 makes every config a (strict) dataclass: fields are class annotations with defaults, the
# generated `__init__` sets them and calls `__post_init__(**extra_kwargs)`, and `validate()` runs the field checks.
# Before 5.4 a config is a plain class whose `__init__(**kwargs)` stores what it is given. `ZooConfigBase` is
# transformers' class where configs are dataclasses, and otherwise a base that gives the zoo's configs the same
# construction protocol, so `ZooConfig` is written once, dataclass-style.
DATACLASS_CONFIGS = hasattr(PreTrainedConfig, "__dataclass_fields__")

if DATACLASS_CONFIGS:
    ZooConfigBase = PreTrainedConfig
else:

    class ZooConfigBase(PreTrainedConfig):
        """Dataclass-style construction on transformers < 5.4: every annotated field of the subclasses (not
        `ClassVar`s) is set from the keyword or its class default (copied, so mutable defaults are not shared), then
        `__post_init__` receives the remaining keywords, as the dataclass `__init__` of newer releases does."""

        def __init__(self, **kwargs) -> None:
            for name, default in _config_fields(type(self)).items():
                setattr(self, name, kwargs.pop(name) if name in kwargs else copy.deepcopy(default))
            self.__post_init__(**kwargs)

        def __post_init__(self, **kwargs) -> None:
            # transformers' own `__init__` handles what is left: label maps, dtype, RoPE keywords (`rope_theta`,
            # `rope_scaling`), attention implementation, and any extra key stored as an attribute. A field a subclass
            # declares that is also one of its own parameters (`is_encoder_decoder`) is handed to it, which would
            # otherwise set its default over the subclass's value.
            own = {name: value for name, value in vars(self).items() if name in _BASE_PARAMETERS}
            PreTrainedConfig.__init__(self, **{**own, **kwargs})

        def validate(self) -> None:
            """transformers < 5.4 has no field validation of its own; the zoo's checks (overrides) are the whole."""


_BASE_PARAMETERS = set(inspect.signature(PreTrainedConfig.__init__).parameters) - {"self", "kwargs"}


def _config_fields(cls: type) -> dict:
    """Field name -> class default of a config class: its annotations and its bases' below `ZooConfigBase`."""
    fields = {}
    for klass in reversed(cls.__mro__[: cls.__mro__.index(ZooConfigBase)]):
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            is_class_var = typing.get_origin(annotation) is typing.ClassVar or str(annotation).startswith("ClassVar")
            if not is_class_var:
                fields[name] = getattr(klass, name, None)
    return fields


# transformers 5.24 renamed the cache keyword and output field `past_key_values` to `cache` (models, layers, mask
# builders, `generate`), keeping the old name as a deprecated alias. The zoo is written with `cache`; CACHE_KWARG is
# the name this release passes between modules and returns in outputs, so that hooks registered `with_kwargs`
# (kvpress's) and callers find the cache where they find Llama's.
CACHE_KWARG = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def takes_past_key_values(forward: Callable) -> Callable:
    """`forward` (written with a `cache` keyword) also takes `past_key_values`, as transformers' modules do: from 5.24
    through transformers' own deprecation (a warning, as Llama gives), before it silently, since there it is the name
    transformers itself passes (`generate`, Llama's layers, exporters' wrappers)."""
    if CACHE_KWARG == "cache":
        from transformers.utils.deprecation import deprecate_kwarg

        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def renamed(*args, past_key_values: Cache | None = None, **kwargs):
        if past_key_values is not None:
            if kwargs.get("cache") is not None:
                raise ValueError("Pass the cache once: `cache` or `past_key_values`, not both.")
            kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return renamed


def returned_cache(output) -> Cache | None:
    """The cache in a model's (or `generate`'s) output, under this release's name for it: `output.cache` from 5.24,
    `output.past_key_values` before (which 5.24 still reads, with a deprecation warning)."""
    return getattr(output, CACHE_KWARG)


def _keep_all(
    batch_idx: torch.Tensor, head_idx: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    return q_idx.new_ones((), dtype=torch.bool)


_SIGNATURES: dict[Callable, frozenset[str]] = {}


@torch.compiler.assume_constant_result
def _takes(function: Callable, keyword: str) -> bool:
    """Whether `function` has a parameter `keyword`: its signature read once, not at every forward. A constant to
    torch.compile (a `functools.cache` wrapper here would be traced through, with a warning at every compile)."""
    if function not in _SIGNATURES:
        _SIGNATURES[function] = frozenset(inspect.signature(function).parameters)
    return keyword in _SIGNATURES[function]


def build_mask(mask_function: Callable, allow_is_causal_skip: bool = True, **kwargs) -> torch.Tensor | None:
    """Call transformers' `create_causal_mask` / `create_sliding_window_causal_mask` with the keywords of newer
    releases, the cache given as `cache` (passed on under this release's name). Before 5.3 (no
    `allow_is_causal_skip` keyword) they need `cache_position`, the positions of the new tokens in the cache, and
    build a materialised mask when given an extra mask function: an all-true one keeps the mask and forces it out,
    where the zoo needs it materialised (ALiBi adds its bias to it)."""
    if CACHE_KWARG != "cache":
        kwargs[CACHE_KWARG] = kwargs.pop("cache", None)
    if _takes(mask_function, "allow_is_causal_skip"):
        kwargs.pop("cache_position", None)
        return mask_function(allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    if kwargs.get("cache_position") is None:
        cache = kwargs[CACHE_KWARG]
        past = cache.get_seq_length() if cache is not None else 0
        length = kwargs["inputs_embeds"].shape[1]
        kwargs["cache_position"] = torch.arange(past, past + length, device=kwargs["inputs_embeds"].device)
    if not allow_is_causal_skip and kwargs.get("and_mask_function") is None:
        kwargs["and_mask_function"] = _keep_all
    return mask_function(**kwargs)


# Before 5.3 transformers threads `cache_position` (the new tokens' slots in the cache) through every layer: Llama's
# model builds it when the caller gives none, and attention hooks (kvpress) read it from the attention keywords.
PASSES_CACHE_POSITION = "cache_position" in inspect.signature(create_causal_mask).parameters


def add_cache_position(kwargs: dict, cache: Cache | None, inputs_embeds: torch.Tensor) -> None:
    """Before 5.3, put the new tokens' slots in the cache into the attention keywords when the caller gave none, as
    Llama's model does there (attention hooks, kvpress's, and static caches read them); from 5.3 nothing."""
    if PASSES_CACHE_POSITION and kwargs.get("cache_position") is None:
        past = cache.get_seq_length() if cache is not None else 0
        kwargs["cache_position"] = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)


def update_cache(
    cache: Cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, attention_kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cache.update(key, value, layer_idx, ...)` with what this release's caches read besides. From 5.24 the
    attention keywords themselves (`kwargs=`), which transformers' paged cache (continuous batching) reads and fills
    in place for the attention function that follows, as Llama passes them; from 5.3 to 5.23 nothing; before 5.3 the
    `cache_kwargs` carrying `cache_position`, where a static cache writes the new keys and values (without it, at slot
    0 onwards)."""
    if CACHE_KWARG == "cache":
        return cache.update(key, value, layer_idx, kwargs=attention_kwargs)
    if PASSES_CACHE_POSITION:
        return cache.update(key, value, layer_idx, {"cache_position": attention_kwargs.get("cache_position")})
    return cache.update(key, value, layer_idx)


def cache_mask_sizes(cache: Cache, query_length: int, layer_idx: int) -> tuple[int, int]:
    """`cache.get_mask_sizes` for `query_length` new tokens: (key length, key offset). Before 5.3 it takes the new
    tokens' `cache_position` (a tensor of which only the length is read) instead of their count."""
    if _takes(type(cache).get_mask_sizes, "query_length"):
        return cache.get_mask_sizes(query_length, layer_idx)
    past = cache.get_seq_length(layer_idx)
    return cache.get_mask_sizes(torch.arange(past, past + query_length), layer_idx)


__all__ = [
    "CACHE_KWARG",
    "DATACLASS_CONFIGS",
    "PASSES_CACHE_POSITION",
    "ZooConfigBase",
    "add_cache_position",
    "build_mask",
    "returned_cache",
    "cache_mask_sizes",
    "slice_logits_to_keep",
    "takes_past_key_values",
    "update_cache",
]


# transformers 5.x added `allow_is_bidirectional_skip` to `create_bidirectional_mask` (False: a mask even where every
# position is allowed); 5.2 always skips, returning None for an unpadded batch.
_ASKS_FOR_A_MASK = "allow_is_bidirectional_skip" in inspect.signature(create_bidirectional_mask).parameters


def bidirectional_mask(*, inputs_embeds: torch.Tensor, allow_is_bidirectional_skip: bool = True, **kwargs):
    """`create_bidirectional_mask`; with `allow_is_bidirectional_skip=False` a mask is returned even where no
    position is masked (an all-True boolean mask on releases that cannot be asked for one)."""
    if _ASKS_FOR_A_MASK:
        return create_bidirectional_mask(
            inputs_embeds=inputs_embeds, allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs
        )
    mask = create_bidirectional_mask(inputs_embeds=inputs_embeds, **kwargs)
    if mask is None and not allow_is_bidirectional_skip:
        batch, length = inputs_embeds.shape[:2]
        mask = torch.ones(batch, 1, length, length, dtype=torch.bool, device=inputs_embeds.device)
    return mask
