"""BigBird: block-sparse attention, each block of queries reading a window of blocks, global blocks and random blocks.

Paper: Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences". What differs from MHA: the tokens are cut
into blocks of `attention_block_size` (b) positions, and the queries of block i see the keys of `num_window_blocks` (w)
neighbouring blocks, `num_global_blocks` (g) global blocks and `num_random_blocks` (r) random blocks only, so a query
scores (w + g + r)·b keys whatever the length: O(T·(w + g + r)·b) time and memory instead of O(T²).

Causal form (the decoder's): block i sees blocks i - w + 1 .. i (its own up to the query itself), the first g blocks,
and r random blocks among the earlier ones that are neither (g .. i - w). A query of a global block (i < g) thus sees
every earlier key, as the paper's global tokens do under a causal mask.

Bidirectional form (an encoder's; the paper's ITC, "internal transformer construction", as in its released code and
transformers' `BigBirdBlockSparseAttention`): block i sees blocks i - (w - 1)/2 .. i + (w - 1)/2 (w odd), the global
blocks, which are the first ceil(g/2) and the last floor(g/2) blocks of the row (g = 2: the first and the last, the
paper's and transformers' layout), and r random blocks among the others; the queries of a global block see every key.

Random blocks are a fixed function of (`random_blocks_seed`, layer, query head, query block), never of the length or
the batch: a checkpoint computes the same function on every machine, and a token decoded from the cache sees what it
sees in a full forward. The choice is an integer hash (exact int64 arithmetic below 2^62, the same on every device)
of (seed, layer, head, query block, key block); the r candidates with the smallest hash are kept. The bidirectional
form draws among the blocks of the row (its candidates depend on the row's length, as the paper's do).

Blocks are counted over true positions (`reads_positions`): a left-padded row or a packed document is cut into the
blocks it has alone. The kernel scatters the queries into blocks, gathers each block's (w + g + r)·b keys and
values by index, and runs a softmax over them; nothing of size T x S is formed unless the weights are asked for. A
graph being compiled or exported cannot size the grid of blocks from the data: there the same pattern runs as a dense
(T, S) mask (`dense_block_sparse_attention`), O(T²).

Cache: keys and values of every token, as GQA (2·L·G·d_h per token): random blocks reach back anywhere. A decoding
step scores (w + g + r)·b keys. Positions: RoPE (default), sinusoidal, learned, none; ALiBi is refused (BigBird uses
absolute positions; a bias over the gathered keys is not implemented). Deviation from the paper: the backbone's
(pre-norm, RoPE by default, GQA grouping); the causal form is the paper's pattern under a causal mask (the paper
defines BigBird for encoders, and its decoder experiments use the same blocks causally); ETC's extra global tokens are
not built.
"""

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import repeat_kv

from .configuration_zoo import HEADS, ZooConfig, check_positive_int, is_int, sized
from .heads_zoo import variant_heads
from .masks_zoo import BlockwiseCausalMask
from .mha import ZooMultiHeadAttention
from .modeling_zoo import ZooModel
from .seq2seq_zoo import seq2seq_classes

HASH_MODULUS = 2**31 - 1  # every hash value is below it, so products stay below 2^62 in int64
KEY_BLOCK_BITS = 24  # ties between equal hashes are broken by the key block's index, in the low bits


class ZooBigBirdConfig(ZooConfig):
    """`attention_block_size` (b): positions per block; `num_window_blocks` (w): blocks of the sliding window, the
    query's own included (odd in an encoder: (w - 1)/2 on either side); `num_global_blocks` (g): blocks every query
    sees (and whose queries see everything); `num_random_blocks` (r): random blocks per query block and head;
    `random_blocks_seed`: the seed of the random blocks, saved with the checkpoint."""

    model_type = "zoo_bigbird"
    paper = 'Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences"'
    arxiv = ("2007.14062",)
    presets = sized(num_attention_heads=HEADS, num_key_value_heads=(2, 2, 4), attention_block_size=(16, 32, 64))
    description = "block-sparse: w window, g global and r random blocks of b keys (Zaheer 2020), O(T·(w+g+r)·b)"
    cache_per_token = "2·L·G·d_h"
    supported_position_types = ("rope", "none", "sinusoidal", "learned")

    attention_block_size: int = 64
    num_window_blocks: int = 3
    num_global_blocks: int = 2
    num_random_blocks: int = 3
    random_blocks_seed: int = 0

    def _check_variant(self) -> None:
        check_positive_int(self, "attention_block_size", "the number of positions per block")
        check_positive_int(self, "num_window_blocks", "the blocks of the sliding window, the query's own included")
        for field, meaning in (
            ("num_global_blocks", "the blocks every query attends to"),
            ("num_random_blocks", "the random blocks each block of queries attends to"),
        ):
            value = getattr(self, field)
            if not is_int(value) or value < 0:
                raise ValueError(f"{field}={value!r} must be an integer >= 0: {meaning}.")
        seed = self.random_blocks_seed
        if not is_int(seed) or not 0 <= seed < HASH_MODULUS:
            raise ValueError(
                f"random_blocks_seed={seed!r} must be an integer in [0, 2^31 - 1): it fixes which random blocks each "
                f"query block attends to."
            )
        if self.num_window_blocks % 2 == 0 and (self.is_encoder_decoder or not self.is_decoder):
            raise ValueError(
                f"num_window_blocks={self.num_window_blocks} must be odd in an encoder: its window is the query's "
                f"own block and (num_window_blocks - 1) / 2 blocks on either side; use "
                f"{self.num_window_blocks - 1} or {self.num_window_blocks + 1}."
            )


def _mix(state: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """One step of the integer hash: both below 2^31, every product below 2^62 (exact in int64 on every device)."""
    state = ((state ^ value) * 1103515245 + 12345) % HASH_MODULUS
    state = state ^ (state >> 16)
    return (state * 69069 + 1) % HASH_MODULUS


def random_block_order(seed: int, layer: int, heads: int, query_blocks: torch.Tensor, key_blocks: int) -> torch.Tensor:
    """The order in which key blocks are drawn for each query head and query block: `(H, Q, K)` int64 sort keys for
    `query_blocks` `(Q,)` and key blocks 0 .. `key_blocks` - 1 (smaller first); the hash of (seed, layer, head, query
    block, key block) in the high bits, the key block in the low ones (no ties)."""
    device = query_blocks.device
    head = torch.arange(heads, device=device)[:, None, None]  # (H, 1, 1)
    key = torch.arange(key_blocks, device=device)[None, None, :]  # (1, 1, K)
    state = torch.full((), seed, dtype=torch.long, device=device)
    state = _mix(_mix(state, layer), head)  # (H, 1, 1)
    state = _mix(_mix(state, query_blocks.long()[None, :, None]), key)  # (H, Q, K)
    return (state << KEY_BLOCK_BITS) | key


def choose_random_blocks(
    order: torch.Tensor, candidates: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` candidate blocks first in `order` (`(..., K)` sort keys, `candidates` `(..., K)` bool): their
    indices `(..., count)` and whether each exists (fewer candidates than `count` near the start of a row)."""
    if count == 0:
        empty = order.new_zeros(*order.shape[:-1], 0)
        return empty, empty.bool()
    never = 2**62  # above every sort key (< 2^55), and exact as the float F.pad takes
    # `count` more blocks that are never candidates, so that there are enough to draw from (short rows); always
    # appended, as a graph being exported cannot branch on the number of key blocks
    masked = F.pad(order.masked_fill(~candidates, never), (0, count), value=never)
    values, blocks = masked.topk(count, dim=-1, largest=False)
    return blocks, values != never


class ZooBigBirdAttention(ZooMultiHeadAttention):
    """GQA projections and cache; the kernel gathers each block of queries' window, global and random blocks."""

    family = "bigbird"
    parent_weights = ("q_proj", "k_proj", "v_proj", "o_proj")  # the parent's scores, kept on the block pattern
    native_format = None  # transformers' BigBird is an encoder of another backbone (post-norm, absolute positions)
    gguf_architecture = None
    backends = ("eager",)  # its own kernel
    compiles_fullgraph = False
    mask_type = "blockwise"
    reads_positions = True  # blocks are counted over true positions
    keeps_scores = "only the keys of each query block's window, global and random blocks"

    @classmethod
    def keys_per_query(cls, config: ZooBigBirdConfig) -> int:
        """The most keys a query block scores: (w + g + r)·b."""
        blocks = config.num_window_blocks + config.num_global_blocks + config.num_random_blocks
        return blocks * config.attention_block_size

    @classmethod
    def mixing_flops_per_token(cls, config: ZooBigBirdConfig, seq_len: int) -> float:
        # dot-product attention over the (w + g + r)·b gathered keys (global queries of an encoder aside)
        return super().mixing_flops_per_token(config, min(seq_len, cls.keys_per_query(config)))

    def attend(self, query, key, value, attention_mask: BlockwiseCausalMask, position_ids=None, **kwargs):
        """`(B, H, T, d)`, `(B, G, S, d)`, `(B, G, S, d_v)` -> `((B, T, H, d_v), weights (B, H, T, S) or None)`."""
        batch, _, length, _ = query.shape
        past = attention_mask.past_length
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=query.device)[None]
        positions = position_ids.expand(batch, length).long()  # (B, T)
        # a graph cannot size the grid of blocks from the data (fullgraph compilation, export): while compiling or
        # exporting, the same pattern as a dense (T, S) mask, O(T·S)
        traced = torch.compiler.is_exporting() or torch.compiler.is_compiling()
        kernel = dense_block_sparse_attention if traced else block_sparse_attention
        return kernel(self, query, key, value, attention_mask, positions, kwargs.get("output_attentions"))

    def random_blocks(self, query_blocks: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's random blocks of `query_blocks` `(Q,)` among `candidates` `(B or 1, Q, K)` (bool over key
        blocks): `(B or 1, H, Q, r)` block indices and whether each exists."""
        config = self.config
        order = random_block_order(
            config.random_blocks_seed, self.layer_idx, self.num_heads, query_blocks, candidates.shape[-1]
        )  # (H, Q, K)
        return choose_random_blocks(order[None], candidates[:, None], config.num_random_blocks)


def key_positions_of(
    positions: torch.LongTensor, mask: BlockwiseCausalMask, key_length: int
) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor | None]:
    """The true positions of the S key slots `(B, S)` (-1 where none), whether each holds a real token `(B, S)`, and
    with a padding mask the offset `(B, 1)` of the positions over the count of real keys before them (else None), for
    queries at `positions` `(B, T)` after `mask.past_length` cached slots.

    With a padding mask, the real keys are counted along the row (padding anywhere, cached or new, is skipped), offset
    so that the real queries keep their given positions; PEFT's prefix tuning, whose virtual tokens sit in the cache
    before a left-padded prompt, thus gets its prefix at positions 0 .. n - 1. Without one, the cached keys continue
    contiguously before the first query and the new keys are the queries (a packed row's restarting positions
    included). Neither branches on `past`: a static cache's fill level is data in an exported graph."""
    batch, length = positions.shape
    past, device = mask.past_length, positions.device
    if mask.key_padding is not None:
        real = mask.key_padding  # (B, S)
        counted = real.long().cumsum(-1) - 1  # (B, S): the count of real keys before, as default positions count
        query_real = real[:, past : past + length]  # (B, T)
        gap = positions - counted[:, past : past + length]  # (B, T): 0 unless positions were given otherwise
        offset = torch.where(query_real, gap, torch.iinfo(torch.long).min).amax(-1, keepdim=True)  # (B, 1)
        offset = torch.where(query_real.any(-1, keepdim=True), offset, 0)
        return torch.where(real, counted + offset, -1), real, offset
    relative = torch.arange(key_length, device=device) - past  # (S,): slot minus the first query's
    key_position = positions.gather(1, relative.clamp(0, length - 1).expand(batch, -1))  # (B, S)
    key_position = torch.where(relative < 0, positions[:, :1] + relative, key_position)
    key_position = torch.where(relative >= length, -1, key_position)
    return key_position, key_position >= 0, None


def slots_holding(
    key_positions: torch.LongTensor, key_real: torch.Tensor, offset: torch.LongTensor | None, origin: torch.Tensor
) -> torch.LongTensor:
    """The key slot of each of `key_positions` `(B, M)`, to be checked against the slot's position (the caller does):
    with a padding mask (`offset`), the slot of the real key counted `position - offset` (padding anywhere skipped, by
    a binary search over the running count); without one the keys are contiguous and it is `origin` `(B, M)`, the
    slot of position 0 of the query's sequence, plus the position. May fall outside [0, S)."""
    if offset is None:
        return origin + key_positions
    running = key_real.long().cumsum(-1)  # (B, S): real keys up to each slot
    return torch.searchsorted(running, (key_positions - offset + 1).contiguous())  # the first slot reaching that count


def block_sparse_attention(
    module: ZooBigBirdAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: BlockwiseCausalMask,
    positions: torch.LongTensor,
    output_attentions: bool | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """BigBird's attention, causal or bidirectional (`mask.causal`). `query` `(B, H, T, d)` at true `positions`
    `(B, T)`, `key` `(B, G, S, d)` and `value` `(B, G, S, d_v)` (the cached ones first) -> `(B, T, H, d_v)` and the
    weights `(B, H, T, S)` when asked for.

    Each query goes into the cell of its block (its position modulo b) of a grid of blocks `(B, H, N, b, d)`; each
    grid block gathers the keys of its blocks, `(B, H, N, (w + g + r)·b, d)`, by slot (`slots_holding`: without
    padding the key at position p of the query's sequence sits p - p_query slots from the query, packed documents
    included; with padding it is found by counting real tokens). A gathered key counts only where its slot holds that
    position, is real and is of the query's document, so nothing is read across a boundary."""
    config = module.config
    block = config.attention_block_size
    batch, heads, length, width = query.shape
    key_length, value_width = key.shape[2], value.shape[-1]
    past, causal, device = mask.past_length, mask.causal, query.device

    # keys: their true positions (the cached ones continue before the first query; a static cache's empty slots -1),
    # whether they are real, their documents
    held = past + length
    key_position, key_real, offset = key_positions_of(positions, mask, key_length)  # (B, S) x 2, (B, 1) or None
    query_real = key_real[:, past:held]  # (B, T)
    query_slot = torch.arange(past, held, device=device).expand(batch, length)  # (B, T): the queries' key slots

    # the grid: a new grid block where the block's first slot or its block changes (or real tokens give way to
    # padding); a block split by padding takes two grid blocks, each computing the block's pattern for its queries
    within = torch.where(query_real, positions % block, query_slot % block)  # (B, T): the cell within the block
    first_slot = query_slot - within  # (B, T)
    position_block = positions // block  # (B, T)
    change = (
        (first_slot[:, 1:] != first_slot[:, :-1])
        | (position_block[:, 1:] != position_block[:, :-1])
        | (query_real[:, 1:] != query_real[:, :-1])
    )  # (B, T - 1)
    grid_block = F.pad(change.long().cumsum(-1), (1, 0))  # (B, T)
    blocks = int(grid_block.max()) + 1  # N
    cell = grid_block * block + within  # (B, T): the query's cell in the flattened grid (B, N·b)

    def per_grid_block(values: torch.Tensor) -> torch.Tensor:
        """A value alike for every query of a grid block, `(B, T)` -> `(B, N)`."""
        return values.new_zeros(batch, blocks).scatter(1, grid_block, values)

    query_block = per_grid_block(torch.where(query_real, position_block, 0))  # (B, N)
    origin = per_grid_block(query_slot - positions)  # (B, N): the slot of position 0 of the block's sequence
    real_block = per_grid_block(query_real.long()).bool()  # (B, N)
    cell_position = positions.new_full((batch, blocks * block), -1).scatter(1, cell, positions)  # (B, N·b)

    if causal:
        key_blocks, block_exists = causal_pattern(module, query_block, real_block)  # (B, H, N, K) x 2
        sequence_blocks = None
    else:
        sequence_blocks = (key_real.sum(-1) + block - 1) // block  # (B,): blocks of each (unpacked) row
        key_blocks, block_exists = bidirectional_pattern(module, query_block, real_block, sequence_blocks)

    # the keys of every grid block: (B, H, N, K, b) slots and the positions they must hold
    cells = torch.arange(block, device=device)
    expected = key_blocks[..., None] * block + cells  # (B, H, N, K, b)
    origins = origin[:, None, :, None, None].expand_as(expected).flatten(1)  # (B, H·N·K·b)
    slots = slots_holding(expected.flatten(1), key_real, offset, origins).view_as(expected)
    inside = (slots >= 0) & (slots < key_length)
    slots = slots.clamp(0, key_length - 1).flatten(2)  # (B, H, N·K·b)
    flat = slots.flatten(1)  # (B, H·N·K·b)
    holds = key_position.gather(1, flat).view_as(slots) == expected.flatten(2)
    usable = (
        block_exists[..., None].expand_as(inside).flatten(2)
        & inside.flatten(2)
        & holds
        & key_real.gather(1, flat).view_as(slots)
    )
    if mask.documents is not None:  # a packed row: the query's document only
        query_document = per_grid_block(mask.documents[:, past:held])  # (B, N)
        same = mask.documents.gather(1, flat).view_as(slots).view(batch, heads, blocks, -1)
        usable = usable & (same == query_document[:, None, :, None]).flatten(2)
    per_block = usable.shape[-1] // blocks  # K·b
    usable = usable.view(batch, heads, blocks, 1, per_block)  # (B, H, N, 1, K·b)
    if causal:  # within the pattern, keys up to the query's own position
        later = expected.flatten(3)[:, :, :, None, :] > cell_position.view(batch, 1, blocks, block, 1)
        allowed = usable & ~later  # (B, H, N, b, K·b)
    else:
        allowed = usable.expand(batch, heads, blocks, block, per_block)

    groups = heads // key.shape[1]
    index = slots[..., None]  # (B, H, N·K·b, 1)
    gathered_key = repeat_kv(key, groups).gather(2, index.expand(-1, -1, -1, width))  # (B, H, N·K·b, d)
    gathered_value = repeat_kv(value, groups).gather(2, index.expand(-1, -1, -1, value_width))
    gathered_key = gathered_key.view(batch, heads, blocks, per_block, width)  # (B, H, N, K·b, d)
    gathered_value = gathered_value.view(batch, heads, blocks, per_block, value_width)
    # (B, H, T, d) -> (B, H, N·b, d) -> (B, H, N, b, d): each query in its cell, empty cells zero
    into_cells = cell[:, None, :, None].expand(batch, heads, length, width)
    grid = query.new_zeros(batch, heads, blocks * block, width).scatter(2, into_cells, query)
    grid = grid.view(batch, heads, blocks, block, width)

    scores = torch.matmul(grid, gathered_key.transpose(-1, -2)) * module.scaling  # (B, H, N, b, K·b)
    probabilities = masked_softmax(scores, allowed).to(query.dtype)
    probabilities = F.dropout(probabilities, module.attention_dropout, training=module.training)
    output = torch.matmul(probabilities, gathered_value).view(batch, heads, blocks * block, value_width)
    from_cells = cell[:, None, :, None].expand(batch, heads, length, value_width)
    output = output.gather(2, from_cells)  # (B, H, T, d_v)

    weights = None
    if output_attentions:  # each cell's weights put back at their key slots, then each query's row
        dense = query.new_zeros(batch, heads, blocks * block, key_length)
        spread = slots.view(batch, heads, blocks, 1, per_block).expand(-1, -1, -1, block, -1)
        dense = dense.view(batch, heads, blocks, block, key_length).scatter_add(-1, spread, probabilities)
        rows = cell[:, None, :, None].expand(batch, heads, length, key_length)
        weights = dense.view(batch, heads, blocks * block, key_length).gather(2, rows)  # (B, H, T, S)

    if not causal and config.num_global_blocks:
        output, weights = global_queries(
            module,
            query,
            key,
            value,
            positions,
            query_real,
            key_real,
            key_position,
            offset,
            sequence_blocks,
            output,
            weights,
        )
    return output.transpose(1, 2), weights  # (B, H, T, d_v) -> (B, T, H, d_v)


def dense_block_sparse_attention(
    module: ZooBigBirdAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: BlockwiseCausalMask,
    positions: torch.LongTensor,
    output_attentions: bool | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same attention as `block_sparse_attention` (same arguments and results) with the pattern as a dense
    `(B, H, T, S)` mask over every key: O(T·S), free of shapes read from the data, for a graph being compiled or
    exported. A key is allowed where its block is in the query's pattern (by the keys' true positions), it is real,
    of the query's document, and (causal) not after the query."""
    config = module.config
    block, window = config.attention_block_size, config.num_window_blocks
    batch, heads, length, _ = query.shape
    key_length = key.shape[2]
    past, causal, device = mask.past_length, mask.causal, query.device
    held = past + length
    key_position, key_real, _ = key_positions_of(positions, mask, key_length)  # (B, S) x 2
    query_block, key_block = positions // block, key_position.clamp(min=0) // block  # (B, T), (B, S)
    distance = query_block[:, :, None] - key_block[:, None, :]  # (B, T, S), in blocks
    blocks = torch.arange((key_length + block - 1) // block + 1, device=device)  # key blocks that may be drawn
    if causal:
        fixed = ((distance >= 0) & (distance < window)) | (key_block[:, None, :] < config.num_global_blocks)
        fixed = fixed & (key_position[:, None, :] <= positions[:, :, None])
        candidates = (blocks >= config.num_global_blocks) & (blocks <= query_block[..., None] - window)  # (B, T, K)
        every = torch.zeros_like(query_block, dtype=torch.bool)  # (B, T)
    else:
        half = (window - 1) // 2
        front, back = global_layout(config)
        total = ((key_real.sum(-1) + block - 1) // block)[:, None]  # (B, 1): blocks of the row
        is_global = (key_block < front) | (key_block >= total - back)  # (B, S)
        fixed = (distance.abs() <= half) | is_global[:, None, :]
        candidates = (
            ((blocks - query_block[..., None]).abs() > half) & (blocks >= front) & (blocks < total[..., None] - back)
        )
        every = (query_block < front) | (query_block >= total - back)  # global queries see every key
    order = random_block_order(
        config.random_blocks_seed, module.layer_idx, heads, query_block.flatten(), blocks.shape[0]
    )  # (H, B·T, K)
    order = order.view(heads, batch, length, -1).transpose(0, 1)  # (B, H, T, K)
    drawn, drawn_exists = choose_random_blocks(order, candidates[:, None], config.num_random_blocks)  # (B, H, T, r)
    hits = (key_block[:, None, None, :, None] == drawn[:, :, :, None, :]) & drawn_exists[:, :, :, None, :]
    allowed = fixed[:, None] | hits.any(-1) | every[:, None, :, None]  # (B, H, T, S)
    allowed = allowed & key_real[:, None, None, :]
    if mask.documents is not None:  # a packed row: the query's document only
        same = mask.documents[:, past:held, None] == mask.documents[:, None, :]  # (B, T, S)
        allowed = allowed & same[:, None]
    groups = heads // key.shape[1]
    scores = torch.matmul(query, repeat_kv(key, groups).transpose(-1, -2)) * module.scaling  # (B, H, T, S)
    probabilities = masked_softmax(scores, allowed).to(query.dtype)
    probabilities = F.dropout(probabilities, module.attention_dropout, training=module.training)
    output = torch.matmul(probabilities, repeat_kv(value, groups)).transpose(1, 2)  # (B, H, T, d_v) -> (B, T, H, d_v)
    return output, probabilities if output_attentions else None


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the allowed scores in float32; a row with none (a padding query, an empty cell) is all zero."""
    empty = ~allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    return F.softmax(scores, dim=-1, dtype=torch.float32).masked_fill(empty, 0.0)


def causal_pattern(
    module: ZooBigBirdAttention, query_block: torch.Tensor, real_block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks of each grid block in the causal form, `(B, H, N, w + g + r)`, and whether each is one: the
    window i - w + 1 .. i, the global blocks 0 .. g - 1 not in it, r random blocks among g .. i - w."""
    config = module.config
    window, global_blocks = config.num_window_blocks, config.num_global_blocks
    device = query_block.device
    batch, blocks = query_block.shape
    heads = module.num_heads
    steps = torch.arange(window - 1, -1, -1, device=device)
    windowed = query_block[..., None] - steps  # (B, N, w)
    first = torch.arange(global_blocks, device=device).expand(batch, blocks, -1)  # (B, N, g)
    fixed = torch.cat((windowed, first), dim=-1)  # (B, N, w + g)
    fixed_exists = torch.cat((windowed >= 0, first <= query_block[..., None] - window), dim=-1)
    # random blocks of the query blocks present (a decoding step has one): drawn once per distinct block
    needed, where = torch.unique(query_block, return_inverse=True)  # (Q,), (B, N)
    key_blocks = torch.arange(int(needed.max()) + 1, device=device)  # (K,)
    candidates = (key_blocks >= global_blocks) & (key_blocks[None, :] <= needed[:, None] - window)  # (Q, K)
    drawn, drawn_exists = module.random_blocks(needed, candidates[None])  # (1, H, Q, r)
    drawn = drawn[0][:, where].permute(1, 0, 2, 3)  # (H, B, N, r) -> (B, H, N, r)
    drawn_exists = drawn_exists[0][:, where].permute(1, 0, 2, 3)
    fixed = fixed[:, None].expand(-1, heads, -1, -1)  # (B, H, N, w + g)
    fixed_exists = (fixed_exists & real_block[..., None])[:, None].expand(-1, heads, -1, -1)
    return torch.cat((fixed, drawn), dim=-1), torch.cat((fixed_exists, drawn_exists), dim=-1)


def global_layout(config: ZooBigBirdConfig) -> tuple[int, int]:
    """The bidirectional form's global blocks: how many at the start of the row and how many at its end."""
    return (config.num_global_blocks + 1) // 2, config.num_global_blocks // 2


def bidirectional_pattern(
    module: ZooBigBirdAttention, query_block: torch.Tensor, real_block: torch.Tensor, sequence_blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks of each grid block in the bidirectional form (ITC), `(B, H, N, w + g + r)`, and whether each
    is one: the window i - h .. i + h (h = (w - 1)/2), the global blocks (first and last of the row) not in it, r
    random blocks among the others. Rows have `sequence_blocks` `(B,)` blocks."""
    config = module.config
    half = (config.num_window_blocks - 1) // 2
    front, back = global_layout(config)
    device = query_block.device
    batch, blocks = query_block.shape
    heads = module.num_heads
    total = sequence_blocks[:, None, None]  # (B, 1, 1)
    windowed = query_block[..., None] + torch.arange(-half, half + 1, device=device)  # (B, N, w)
    first = torch.arange(front, device=device).expand(batch, blocks, -1)  # (B, N, g_front)
    last = total - back + torch.arange(back, device=device)  # (B, 1, g_back)
    last = last.expand(batch, blocks, -1)
    away = half  # a global block already in the window is not counted twice
    first_exists = ((first - query_block[..., None]).abs() > away) & (first < total)
    last_exists = ((last - query_block[..., None]).abs() > away) & (last >= front)
    fixed = torch.cat((windowed, first, last), dim=-1)  # (B, N, w + g)
    fixed_exists = torch.cat(((windowed >= 0) & (windowed < total), first_exists, last_exists), dim=-1)
    needed, where = torch.unique(query_block, return_inverse=True)  # (Q,), (B, N)
    key_blocks = torch.arange(int(sequence_blocks.max()), device=device)  # (K,)
    rows = sequence_blocks[:, None, None]  # (B, 1, 1)
    candidates = (
        ((key_blocks[None, :] - needed[:, None]).abs() > half)[None]  # (1, Q, K): outside the window
        & (key_blocks >= front)
        & (key_blocks < rows - back)
    )  # (B, Q, K)
    drawn, drawn_exists = module.random_blocks(needed, candidates)  # (B, H, Q, r)
    index = where[:, None, :, None].expand(-1, heads, -1, drawn.shape[-1])  # (B, H, N, r)
    drawn, drawn_exists = drawn.gather(2, index), drawn_exists.gather(2, index)
    fixed = fixed[:, None].expand(-1, heads, -1, -1)  # (B, H, N, w + g)
    fixed_exists = (fixed_exists & real_block[..., None])[:, None].expand(-1, heads, -1, -1)
    return torch.cat((fixed, drawn), dim=-1), torch.cat((fixed_exists, drawn_exists), dim=-1)


def global_queries(
    module: ZooBigBirdAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.LongTensor,
    query_real: torch.Tensor,
    key_real: torch.Tensor,
    key_position: torch.LongTensor,
    offset: torch.LongTensor | None,
    sequence_blocks: torch.Tensor,
    output: torch.Tensor,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bidirectional form's global queries (those of the first and last blocks) attend to every real key of the
    row: at most g·b queries per row against S keys, O(T·g·b). Their rows of `output` `(B, H, T, d_v)` (and of
    `weights`) are replaced."""
    config = module.config
    block = config.attention_block_size
    front, back = global_layout(config)
    batch, heads, length, width = query.shape
    device = query.device
    # the global positions of each row: the first front·b, then the last back blocks' (B, g·b)
    head_positions = torch.arange(front * block, device=device).expand(batch, -1)
    tail_start = (sequence_blocks - back).clamp(min=0)[:, None] * block  # (B, 1)
    tail_positions = tail_start + torch.arange(back * block, device=device)  # (B, back·b)
    global_positions = torch.cat((head_positions, tail_positions), dim=-1)  # (B, g·b)
    real_tokens = key_real.sum(-1, keepdim=True)  # (B, 1): the row's length
    # a tail position inside the head blocks (a short row) is already there, and positions past the row are none
    in_head = torch.arange(global_positions.shape[1], device=device) < front * block  # (g·b,)
    exists = (global_positions < real_tokens) & (in_head | (global_positions >= front * block))  # (B, g·b)
    # the slot of each (an encoder's queries are its keys): without padding, position 0 sits where any real query's
    # slot minus its position says
    slot_of_first = torch.where(query_real, torch.arange(length, device=device) - positions, length)
    origin = slot_of_first.min(-1, keepdim=True).values.expand_as(global_positions)  # (B, g·b)
    slots = slots_holding(global_positions, key_real, offset, origin)  # (B, g·b)
    inside = (slots >= 0) & (slots < length)
    exists = exists & inside & (key_position.gather(1, slots.clamp(0, length - 1)) == global_positions)
    slots = torch.where(exists, slots, length)  # length: no such query
    index = slots.clamp(max=length - 1)[:, None, :, None]  # (B, 1, g·b, 1)
    selected = query.gather(2, index.expand(batch, heads, -1, width))  # (B, H, g·b, d)
    groups = heads // key.shape[1]
    scores = torch.matmul(selected, repeat_kv(key, groups).transpose(-1, -2)) * module.scaling  # (B, H, g·b, S)
    allowed = key_real[:, None, None, :].expand_as(scores)
    probabilities = masked_softmax(scores, allowed).to(query.dtype)
    probabilities = F.dropout(probabilities, module.attention_dropout, training=module.training)
    dense = torch.matmul(probabilities, repeat_kv(value, groups))  # (B, H, g·b, d_v)
    # written over the sparse rows; a slot of `length` (no such query) lands in a column that is dropped
    target = slots[:, None, :, None]
    output = F.pad(output, (0, 0, 0, 1)).scatter(2, target.expand(-1, heads, -1, output.shape[-1]), dense)
    output = output[:, :, :length]
    if weights is not None:
        weights = F.pad(weights, (0, 0, 0, 1)).scatter(
            2, target.expand(-1, heads, -1, weights.shape[-1]), probabilities
        )
        weights = weights[:, :, :length]
    return output, weights


class ZooBigBirdModel(ZooModel):
    config_class = ZooBigBirdConfig
    attention_class = ZooBigBirdAttention


(
    ZooBigBirdForCausalLM,
    ZooBigBirdForSequenceClassification,
    ZooBigBirdForTokenClassification,
    ZooBigBirdForQuestionAnswering,
) = variant_heads(ZooBigBirdModel)
(
    ZooBigBirdEncoder,
    ZooBigBirdDecoder,
    ZooBigBirdSeq2SeqModel,
    ZooBigBirdForConditionalGeneration,
) = seq2seq_classes(ZooBigBirdModel)
