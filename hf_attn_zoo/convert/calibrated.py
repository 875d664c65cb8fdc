"""Calibrated MHA -> GQA/MQA conversions: what the key/value heads compute on calibration text decides how they are
pooled, where mean pooling (Ainslie et al. 2023) averages projection rows blind.

Three methods, each changing only which rows and columns of `q_proj`, `k_proj`, `v_proj` and `o_proj` hold what, so
the converted model has exactly the parameters of a mean-pooled one; all end in mean pooling of contiguous groups:

- "aligned", after Jin et al. (EMNLP Findings 2025), who align heads by orthogonal Procrustes before merging them:
  within each group, every key/value head is rotated onto the group's consensus, then the group is averaged. Values
  may take any orthogonal map R (head j's values v R; `o_proj`'s columns for the query heads reading head j take R
  back). Keys may take only maps that commute with RoPE, one 2-D rotation per frequency plane (channels i and
  i + d/2, transformers' pairing), with the queries of head j rotated alike, so that q . k is unchanged at every
  pair of positions; without RoPE any orthogonal map. Deviations: the consensus is generalised Procrustes (align to
  the mean, recompute, `ALIGNMENT_ITERATIONS` times) rather than one reference head, and the rotations are fitted on
  the calibration tokens' keys and values before RoPE (a per-plane rotation at the same position cancels out, so
  this is the same fit).
- "grouped", after AsymGQA (Chen et al. 2024) and QCQA (Joshi et al. 2024), who group heads by what they compute
  rather than by their index: the heads that share a new key/value head are chosen by the distance between their
  keys and values on the calibration text (greedy: the closest free pair seeds a group, which takes the free head
  nearest to it on average until full), and the query heads are permuted with their key/value heads. Deviation:
  groups keep equal size (AsymGQA allows unequal ones; transformers' `repeat_kv` layout needs equal ones). ALiBi
  gives each query head position its own slope, so query heads cannot move there: refused.
- "grouped_aligned": both, the grouping by the distance left after aligning each pair of heads, so that heads
  that differ by a rotation count as close; then aligned pooling of those groups.

All are exact where they must be: G equal to the model's key/value heads is the identity; heads that are rotations
of one another within a group ("aligned"), identical heads anywhere in the layer ("grouped") or rotations of one
another anywhere in it ("grouped_aligned") convert without changing the model's function.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

ALIGNMENT_ITERATIONS = 3
CALIBRATION_TOKENS_PER_CHANNEL = 4  # at least 4 x head_dim tokens: an orthogonal fit in d dimensions needs d at least
CALIBRATION_METHODS = ("aligned", "grouped", "grouped_aligned")


def calibration_batches(
    calibration, tokenizer, max_length: int, max_tokens: int | None = None
) -> list[torch.LongTensor]:
    """`calibration` as `(1, T)` token tensors of at most `max_length` tokens, `max_tokens` in all (when given):
    texts (with `tokenizer`), a `(B, T)` tensor or a sequence of token id lists or tensors."""
    if calibration is None:
        raise ValueError("calibration=None: calibrated methods need calibration text or token batches.")
    if isinstance(calibration, str):
        calibration = [calibration]
    if isinstance(calibration, torch.Tensor):
        calibration = list(calibration.reshape(-1, calibration.shape[-1]))
    sequences, budget = [], float("inf") if max_tokens is None else max_tokens
    for item in calibration:
        if budget <= 0:
            break  # texts past the budget are not even tokenized
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("calibration holds texts: pass the model's tokenizer (tokenizer=...) to read them.")
            item = tokenizer(item, add_special_tokens=False)["input_ids"]
        sequence = torch.as_tensor(item, dtype=torch.long).reshape(-1)
        if sequence.numel() > budget:
            sequence = sequence[: int(budget)]
        budget -= sequence.numel()
        sequences += [chunk[None] for chunk in sequence.split(max_length) if chunk.numel() > 0]
    return sequences


@torch.no_grad()
def run_hooked(
    model, batches: Sequence[torch.LongTensor], attach: Callable[[int, nn.Module], Iterable[RemovableHandle]]
) -> None:
    """Plain forwards of the calibration `batches` through `model.model` (eval mode, no cache), with the hooks that
    `attach(index, layer)` registers on each decoder layer in place; whatever happens, the hooks are removed and the
    model's training mode is restored afterwards. The hooks collect what a conversion fits on."""
    handles: list[RemovableHandle] = []
    training = model.training
    try:
        for index, layer in enumerate(model.model.layers):
            handles.extend(attach(index, layer))
        model.eval()
        for batch in batches:
            model.model(input_ids=batch.to(model.device), use_cache=False)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()


def key_value_activations(model, batches: Sequence[torch.LongTensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the calibration tokens' keys `(N, G0, d_qk)` (before RoPE) and values `(N, G0, d_v)`: the outputs
    of `k_proj` and `v_proj`, caught by hooks during plain forwards."""
    kv_heads = model.config.num_key_value_heads
    caught: dict[tuple[int, str], list[torch.Tensor]] = {}

    def attach(index: int, layer: nn.Module) -> Iterator[RemovableHandle]:
        for name in ("k_proj", "v_proj"):

            def keep(module, inputs, output, key=(index, name)):
                caught.setdefault(key, []).append(output.reshape(-1, output.shape[-1]))  # (B T, G0 d)

            yield getattr(layer.self_attn, name).register_forward_hook(keep)

    run_hooked(model, batches, attach)
    return [
        tuple(torch.cat(caught[(index, name)]).unflatten(-1, (kv_heads, -1)).double() for name in ("k_proj", "v_proj"))
        for index in range(len(model.model.layers))
    ]


@torch.no_grad()
def seq2seq_key_value_activations(
    model, pairs: Sequence[tuple[torch.LongTensor, torch.LongTensor]]
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per decoder attention module of an encoder-decoder (`self_attn`, `encoder_attn`), per layer: the keys
    `(N, G0, d_qk)` (before RoPE) and values `(N, G0, d_v)` it computes on the calibration `pairs` (`(1, S)` source
    and `(1, T)` target ids, teacher-forced: the target shifted right is the decoder's input). The cross-attention's
    come from the encoder's outputs, one row per source token."""
    caught: dict[tuple[str, int, str], list[torch.Tensor]] = {}
    handles: list[RemovableHandle] = []
    layers = model.model.decoder.layers
    training = model.training
    try:
        for index, layer in enumerate(layers):
            for module in ("self_attn", "encoder_attn"):
                for name in ("k_proj", "v_proj"):

                    def keep(_, inputs, output, key=(module, index, name)):
                        caught.setdefault(key, []).append(output.reshape(-1, output.shape[-1]))  # (B T, G0 d)

                    handles.append(getattr(getattr(layer, module), name).register_forward_hook(keep))
        model.eval()
        for source, target in pairs:
            model(input_ids=source.to(model.device), labels=target.to(model.device), use_cache=False)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    heads = {
        "self_attn": model.config.num_key_value_heads,
        "encoder_attn": model.config.cross_attention_num_key_value_heads,
    }
    return {
        module: [
            tuple(
                torch.cat(caught[(module, index, name)]).unflatten(-1, (heads[module], -1)).double()  # (N, G0, d)
                for name in ("k_proj", "v_proj")
            )
            for index in range(len(layers))
        ]
        for module in heads
    }


def check_enough(tokens: int, head_dim: int) -> None:
    needed = CALIBRATION_TOKENS_PER_CHANNEL * head_dim
    if tokens < needed:
        raise ValueError(
            f"calibration gives {tokens} tokens, too few to fit the heads' rotations: pass at least {needed} "
            f"({CALIBRATION_TOKENS_PER_CHANNEL} x head_dim={head_dim}), a few thousand for a stable fit."
        )


def procrustes(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The orthogonal `R` minimising ||source R - target|| (Schönemann 1966): `U V^T` from the SVD of
    `source^T target`. `(N, d)`, `(N, d)` -> `(d, d)`."""
    u, _, vh = torch.linalg.svd(source.T @ target)
    return u @ vh


def plane_rotations(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The map minimising ||source M - target|| among those that commute with RoPE: one 2-D rotation per frequency
    plane (channels i and i + d/2). Read as complex numbers z = x_i + i x_{i+d/2}, each plane's best rotation is
    e^{i theta} with theta = arg sum(conj(z_source) z_target). `(N, d)`, `(N, d)` -> `(d, d)`."""
    half = source.shape[-1] // 2
    z_source = torch.complex(source[:, :half], source[:, half:])  # (N, d/2)
    z_target = torch.complex(target[:, :half], target[:, half:])
    theta = torch.angle((z_source.conj() * z_target).sum(0))  # (d/2,)
    cos, sin = theta.cos(), theta.sin()
    rotation = torch.zeros(2 * half, 2 * half, dtype=cos.dtype)
    index = torch.arange(half)
    # row-vector convention, x M: (a, b) -> (a cos - b sin, a sin + b cos), i.e. z e^{i theta}
    rotation[index, index] = cos
    rotation[index + half, index + half] = cos
    rotation[index, index + half] = sin
    rotation[index + half, index] = -sin
    return rotation


def consensus_rotations(activations: torch.Tensor, fit) -> list[torch.Tensor]:
    """Generalised Procrustes over the heads of one group: `(N, n, d)` -> one `(d, d)` map per head, aligning each
    head onto the mean of the aligned heads, refitted `ALIGNMENT_ITERATIONS` times from the first head."""
    heads = activations.shape[1]
    reference = activations[:, 0]
    for _ in range(ALIGNMENT_ITERATIONS):
        maps = [fit(activations[:, j], reference) for j in range(heads)]
        reference = torch.stack([activations[:, j] @ maps[j] for j in range(heads)]).mean(0)
    return maps


def greedy_groups(cost: torch.Tensor, size: int) -> list[list[int]]:
    """Equal groups of `size` heads with small within-group cost (`cost`: `(n, n)`, symmetric): the closest free pair
    seeds a group, which then takes the free head with the smallest mean cost to its members until full."""
    free = set(range(cost.shape[0]))
    groups = []
    while free:
        if size == 1 or len(free) == size:
            seed = sorted(free)[:size] if size == len(free) else [min(free)]
        else:
            pairs = [(cost[i, j].item(), i, j) for i in sorted(free) for j in sorted(free) if i < j]
            _, i, j = min(pairs)
            seed = [i, j]
        group = list(seed)
        free -= set(group)
        while len(group) < size:
            nearest = min(sorted(free), key=lambda head: cost[head, group].mean().item())
            group.append(nearest)
            free.discard(nearest)
        groups.append(sorted(group))
    return sorted(groups)


def head_distances(keys: torch.Tensor, values: torch.Tensor, key_fit=None) -> torch.Tensor:
    """Squared distance between heads' keys plus that between their values, each relative to the heads' mean
    squared norm: `(N, G0, d)` twice -> `(G0, G0)`. With `key_fit` (the keys' alignment; values take any rotation),
    the distance left after aligning head j onto head i."""

    def relative(x: torch.Tensor, fit) -> torch.Tensor:
        heads = x.shape[1]
        if fit is None:
            flat = x.transpose(0, 1).flatten(1)  # (G0, N d)
            distance = torch.cdist(flat, flat).square()
        else:
            distance = torch.zeros(heads, heads, dtype=x.dtype)
            for i in range(heads):
                for j in range(heads):
                    if i != j:
                        distance[i, j] = (x[:, j] @ fit(x[:, j], x[:, i]) - x[:, i]).square().sum()
            distance = (distance + distance.T) / 2  # the fits are not exactly symmetric
        return distance / x.square().sum((0, 2)).mean().clamp_min(1e-12)

    return relative(keys, key_fit) + relative(values, None if key_fit is None else procrustes)


class HeadRewrite:
    """The function-preserving rewrite of one layer's attention projections before pooling: a permutation of the
    key/value heads (the query heads moving with them) and, per key/value head, an orthogonal map on its keys
    (mirrored on its queries) and one on its values (undone in `o_proj`)."""

    def __init__(self, heads: int, kv_heads: int, qk_dim: int, v_dim: int) -> None:
        self.heads, self.kv_heads, self.qk_dim, self.v_dim = heads, kv_heads, qk_dim, v_dim
        self.order = list(range(kv_heads))  # new position p holds old key/value head order[p]
        self.key_maps = [torch.eye(qk_dim) for _ in range(kv_heads)]  # indexed by old head
        self.value_maps = [torch.eye(v_dim) for _ in range(kv_heads)]

    def apply(self, attention: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`attention`: this layer's `q_proj` / `k_proj` / `v_proj` / `o_proj` weights and biases by short name
        (`q_proj.weight`, ...); returns them rewritten."""
        per_query = self.heads // self.kv_heads
        out = dict(attention)

        def heads_of(name: str, count: int, dim: int) -> torch.Tensor:
            return attention[name].reshape(count, dim, *attention[name].shape[1:])  # (heads, d_h, [hidden])

        for kind, count, dim, maps in (
            ("k_proj", self.kv_heads, self.qk_dim, self.key_maps),
            ("v_proj", self.kv_heads, self.v_dim, self.value_maps),
            ("q_proj", self.heads, self.qk_dim, self.key_maps),
        ):
            for suffix in ("weight", "bias"):
                name = f"{kind}.{suffix}"
                if name not in attention:
                    continue
                rows = heads_of(name, count, dim)
                rewritten = []
                for new_head in range(count):
                    old_kv = self.order[new_head // per_query] if kind == "q_proj" else self.order[new_head]
                    old_head = old_kv * per_query + new_head % per_query if kind == "q_proj" else old_kv
                    block = rows[old_head].to(torch.float64)  # (d_h, [hidden]): y_h = W_h x, rewritten as M^T W_h
                    rewritten.append(maps[old_kv].to(torch.float64).T @ block)
                out[name] = torch.stack(rewritten).reshape(attention[name].shape).to(attention[name].dtype)
        # o_proj: columns of query head h (reading old key/value head j) take the value map back: W_o,h R_j
        columns = attention["o_proj.weight"].unflatten(1, (self.heads, self.v_dim))  # (hidden, H, d_v)
        rewritten = []
        for new_head in range(self.heads):
            old_kv = self.order[new_head // per_query]
            old_head = old_kv * per_query + new_head % per_query
            rewritten.append(columns[:, old_head].to(torch.float64) @ self.value_maps[old_kv].to(torch.float64))
        out["o_proj.weight"] = torch.stack(rewritten, 1).flatten(1).to(attention["o_proj.weight"].dtype)
        return out


def rewrite_for_pooling(
    layer_activations: list[tuple[torch.Tensor, torch.Tensor]], config, groups: int, method: str
) -> list[HeadRewrite]:
    """One `HeadRewrite` per layer such that pooling contiguous groups of the rewritten key/value heads pools the
    heads `method` chooses, aligned where it aligns."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    size = kv_heads // groups
    rotary = getattr(config, "position_embedding_type", "rope") == "rope"
    if method.startswith("grouped") and getattr(config, "position_embedding_type", None) == "alibi":
        raise ValueError(
            f"method={method!r} reorders query heads, but ALiBi gives each head position its own slope, so the model "
            "would change: use method='aligned' or 'mean' for an ALiBi model."
        )
    key_fit = plane_rotations if rotary else procrustes
    rewrites = []
    for keys, values in layer_activations:
        rewrite = HeadRewrite(heads, kv_heads, keys.shape[-1], values.shape[-1])
        if method in ("grouped", "grouped_aligned"):
            distances = head_distances(keys, values, key_fit if method == "grouped_aligned" else None)
            rewrite.order = [head for group in greedy_groups(distances, size) for head in group]
        if method in ("aligned", "grouped_aligned"):
            for start in range(0, kv_heads, size):
                members = rewrite.order[start : start + size]
                key_maps = consensus_rotations(keys[:, members], key_fit)
                value_maps = consensus_rotations(values[:, members], procrustes)
                for member, key_map, value_map in zip(members, key_maps, value_maps, strict=True):
                    rewrite.key_maps[member], rewrite.value_maps[member] = key_map, value_map
        rewrites.append(rewrite)
    return rewrites


__all__ = [
    "CALIBRATION_METHODS",
    "HeadRewrite",
    "calibration_batches",
    "key_value_activations",
    "rewrite_for_pooling",
    "seq2seq_key_value_activations",
]
