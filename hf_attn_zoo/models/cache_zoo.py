"""A transformers `Cache` for variants that decode from a state instead of a growing key/value cache.

Linformer keeps its compressed keys and values, AFT-simple three running sums per channel, AFT-local those sums
plus its last few keys. Each layer holds named tensors whose first dimension is the batch, so beam search
(`reorder_cache`), batch expansion and selection work on any state. Removing tokens (`crop`, used by assisted and
contrastive decoding) is impossible from a running sum and raises instead of returning silently wrong output.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class ZooStateLayer(CacheLayerMixin):
    """One layer's decoding state: named tensors `(B, ...)` and the number of tokens folded into them."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate ahead: the first `write` sets the state."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} holds a decoding state, not keys and values: use `read` and `write`")

    def read(self) -> dict[str, torch.Tensor] | None:
        """The state after the tokens seen so far, or None before the first token."""
        return self.state or None

    def write(self, state: dict[str, torch.Tensor], new_tokens: int) -> None:
        self.state = state
        self.seen_tokens += new_tokens
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.3 passes the new tokens' cache positions
            query_length = query_length.shape[0]
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the same question under its name before transformers 5.3
        return -1

    def reset(self) -> None:
        self.state, self.seen_tokens, self.is_initialized = {}, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = {name: t.index_select(0, beam_idx.to(t.device)) for name, t in self.state.items()}

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = {name: t.repeat_interleave(repeats, dim=0) for name, t in self.state.items()}

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = {name: t[indices] for name, t in self.state.items()}

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                "this variant decodes from a running state, from which tokens cannot be removed: decoding strategies "
                "that roll the cache back (assisted or prompt-lookup decoding, contrastive search) do not apply; use "
                "greedy, sampling or beam search."
            )

    def offload(self) -> None:
        self.state = {name: t.to("cpu", non_blocking=True) for name, t in self.state.items()}

    def prefetch(self) -> None:
        if self.state and self.device is not None:
            self.state = {name: t.to(self.device, non_blocking=True) for name, t in self.state.items()}

    # A state layer has no per-token keys and values. Tools that read or rewrite `cache.layers[i].keys` (kvpress's
    # presses evict cached tokens by score) would otherwise get None and fail far from the cause, or drop tokens that
    # a running sum has already folded in: reading them is an AttributeError saying why (`hasattr` is then False).
    @property
    def keys(self) -> torch.Tensor:
        raise AttributeError(self._no_keys_and_values("keys"))

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:  # `CacheLayerMixin.__init__` sets None
            raise AttributeError(self._no_keys_and_values("keys"))

    @property
    def values(self) -> torch.Tensor:
        raise AttributeError(self._no_keys_and_values("values"))

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError(self._no_keys_and_values("values"))

    def _no_keys_and_values(self, name: str) -> str:
        return (
            f"{type(self).__name__} has no per-token {name}: this variant decodes from a running state per layer "
            f"that folds in every token seen, not a cache of one key and value per token, so tools that read or "
            f"evict cached tokens (KV cache compression such as kvpress's presses) cannot apply to it."
        )

    @property
    def device(self) -> torch.device | None:
        return next(iter(self.state.values())).device if self.state else None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


class ZooStateCache(Cache):
    """A cache of state layers (`ZooStateLayer`, or the variant's subclass of it), one per decoder layer."""

    def __init__(self, num_layers: int, layer_class: type[ZooStateLayer] = ZooStateLayer) -> None:
        super().__init__(layers=[layer_class() for _ in range(num_layers)])


def state_layer(cache: Cache | None, layer_idx: int, model_type: str) -> ZooStateLayer | None:
    """The state layer of `layer_idx`, or a clear error when the cache is not one this variant can use."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    if not isinstance(layer, ZooStateLayer):
        raise TypeError(
            f"{model_type} decodes from a state per layer and cannot use a {type(cache).__name__} of "
            f"key/value layers; pass cache=model.model.make_cache(), or let generate() create it."
        )
    return layer
