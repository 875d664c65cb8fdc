"""Naive reference implementations, written for clarity rather than speed, that the fast paths are tested against.

They reuse a model's parameters (projections, norms, MLP) but recompute attention and positions from the papers'
formulas: explicit loops over batch rows and heads, dense boolean masks, and positions counted over real tokens.
"""

import math
from functools import partial

import torch


def true_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real (unpadded) tokens of its row; pads get 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def paper_alibi_slopes(num_heads: int) -> list[float]:
    """Press et al. 2022: slopes 2^(-8i/n) for i = 1..n when n is a power of two; otherwise the slopes of the
    closest power of two below n, then every other slope of the next power of two."""
    if num_heads & (num_heads - 1) == 0:
        return [2.0 ** (-8.0 * i / num_heads) for i in range(1, num_heads + 1)]
    closest = 2 ** int(math.log2(num_heads))
    extra = [2.0 ** (-8.0 * i / (2 * closest)) for i in range(1, 2 * closest + 1)][0::2]
    return paper_alibi_slopes(closest) + extra[: num_heads - closest]


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on `(B, T, heads, d)`: channel i and i + d/2 form a pair rotated by position * theta^(-2i/d)."""
    d = x.shape[-1]
    frequencies = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angles = positions[..., None].double() * frequencies  # (B, T, d/2)
    cos, sin = angles.cos()[:, :, None, :].to(x.dtype), angles.sin()[:, :, None, :].to(x.dtype)
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i + 1) = cos(p / 10000^(2i/d))."""
    table = torch.zeros(*positions.shape, dim, dtype=torch.float64)
    for i in range(dim // 2):
        angle = positions.double() / 10000 ** (2 * i / dim)
        table[..., 2 * i] = angle.sin()
        table[..., 2 * i + 1] = angle.cos()
    return table.float()


def scored_attention(attn, hidden, positions, attention_mask, config, score, keep=None, causal=True):
    """Attention with an arbitrary score, one (row, head) at a time: query head h reads key/value head h // (H / G);
    `score(q_i, keys, h)` gives the scores of one query against all keys; ALiBi adds its bias; with
    `config.sliding_window` = w a query sees the keys at most w - 1 positions back; with `keep`, only the `keep` best
    allowed scores of each query enter the softmax. `causal=False` is an encoder's form: every real key, within w - 1
    positions on either side, ALiBi over the absolute distance."""
    batch, length, _ = hidden.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qk_dim = attn.query_key_dim
    q = attn.q_proj(hidden).view(batch, length, heads, qk_dim)
    k = attn.k_proj(hidden).view(batch, length, kv_heads, qk_dim)
    v = attn.v_proj(hidden).view(batch, length, kv_heads, head_dim)
    if config.position_embedding_type == "rope":
        theta = config.rope_parameters["rope_theta"]
        q, k = rotate(q, positions, theta), rotate(k, positions, theta)
    slopes = paper_alibi_slopes(heads)
    window = getattr(config, "sliding_window", None)
    out = torch.zeros(batch, length, heads, head_dim)
    order = torch.ones(length, length, dtype=torch.bool)
    order = order.tril() if causal else order
    for b in range(batch):
        allowed = order & attention_mask[b].bool()[None, :]
        distance = positions[b][:, None] - positions[b][None, :]  # (T, T): query minus key position
        distance = distance if causal else distance.abs()
        if window is not None:
            allowed = allowed & (distance < window)
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                scores = score(q[b, i, h], k[b, :, g], h)  # (S,)
                if config.position_embedding_type == "alibi":
                    scores = scores - slopes[h] * distance[i]
                visible = allowed[i].clone()
                if not visible.any():  # a padding query: its output is never compared
                    continue
                if keep is not None and visible.sum() > keep:
                    best = scores.masked_fill(~visible, float("-inf")).topk(keep).indices
                    visible = torch.zeros_like(visible)
                    visible[best] = True
                probabilities = scores.masked_fill(~visible, float("-inf")).softmax(-1)
                out[b, i, h] = probabilities @ v[b, :, g]
    return attn.o_proj(out.reshape(batch, length, heads * head_dim))


def softmax_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Scaled dot-product attention (MHA, GQA, MQA, sliding window)."""
    scale = attn.query_key_dim**-0.5
    return scored_attention(
        attn, hidden, positions, attention_mask, config, lambda q, keys, h: keys @ q * scale, causal=causal
    )


def topk_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Gupta et al. 2021: the softmax over each query's `topk` best scaled dot products."""
    scale = attn.query_key_dim**-0.5
    score = lambda q, keys, h: keys @ q * scale  # noqa: E731
    return scored_attention(attn, hidden, positions, attention_mask, config, score, keep=config.topk, causal=causal)


def alibi_distance(distance: torch.Tensor, causal: bool) -> torch.Tensor:
    """ALiBi's distance from a query to its keys: i - j looking back, |i - j| in an encoder, which sees both ways."""
    return distance if causal else distance.abs()


def latent_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """DeepSeek-AI 2024 (DeepSeek-V2, section 2.1): c = RMSNorm(W_DKV x) (W_DKV x with `latent_norm=False`), per
    head k_h = [W_UK,h c; k_rope] and v_h = W_UV,h c, k_rope = RoPE(W_KR x) shared by every head, q_h = [q_nope,h;
    RoPE(q_rope,h)]; softmax over q_h . k_h / sqrt(nope + rope). With `rope_frequencies`, layer l's RoPE part rotates
    by the chosen frequencies i of rope_theta^(-2i/head_dim)."""
    batch, length, _ = hidden.shape
    heads, nope, rope, v_dim, r = (
        config.num_attention_heads,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    )
    if config.q_lora_rank is None:
        q = attn.q_proj(hidden)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
    q = q.view(batch, length, heads, nope + rope)
    compressed = attn.kv_a_proj_with_mqa(hidden)
    c = compressed[..., :r] if attn.kv_a_layernorm is None else attn.kv_a_layernorm(compressed[..., :r])  # (B, T, r)
    k_rope = compressed[..., r:].view(batch, length, 1, rope)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    if config.position_embedding_type == "rope":
        theta = config.rope_parameters["rope_theta"]
        if config.rope_frequencies is None:
            q_rope, k_rope = rotate(q_rope, positions, theta), rotate(k_rope, positions, theta)
        else:  # rotate at the full ladder of head_dim, keeping the chosen frequencies' channels
            chosen = config.rope_frequencies[attn.layer_idx]
            half = config.head_dim // 2
            channels = [*chosen, *(i + half for i in chosen)]

            def rotate_chosen(x):
                wide = torch.zeros(*x.shape[:-1], config.head_dim)
                wide[..., channels] = x
                return rotate(wide, positions, theta)[..., channels]

            q_rope, k_rope = rotate_chosen(q_rope), rotate_chosen(k_rope)
    up = attn.kv_b_proj.weight.view(heads, nope + v_dim, r)
    slopes = paper_alibi_slopes(heads)
    out = torch.zeros(batch, length, heads, v_dim)
    # an encoder (`causal=False`) lets every real key in, and ALiBi reads the distance either way
    order = torch.ones(length, length, dtype=torch.bool)
    order = order.tril() if causal else order
    for b in range(batch):
        allowed = order & attention_mask[b].bool()[None, :]
        for h in range(heads):
            keys = torch.cat((c[b] @ up[h, :nope].T, k_rope[b, :, 0]), dim=-1)  # (S, nope + rope)
            values = c[b] @ up[h, nope:].T  # (S, v)
            for i in range(length):
                if not allowed[i].any():  # a padding query: its output is never compared
                    continue
                scores = keys @ torch.cat((q_nope[b, i, h], q_rope[b, i, h])) / math.sqrt(nope + rope)
                if config.position_embedding_type == "alibi":
                    scores = scores - slopes[h] * alibi_distance(positions[b, i] - positions[b], causal)
                out[b, i, h] = scores.masked_fill(~allowed[i], float("-inf")).softmax(-1) @ values
    return attn.o_proj(out.reshape(batch, length, heads * v_dim))


def additive_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Bahdanau et al. 2015: score(q, k) = v_h . tanh(q + k), q and k already projected (W_q x, W_k x)."""
    vector = attn.score_vector
    score = lambda q, keys, h: torch.tanh(q + keys) @ vector[h]  # noqa: E731
    return scored_attention(attn, hidden, positions, attention_mask, config, score, causal=causal)


def differential_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Ye et al. 2024: per head, (softmax(Q1 K1ᵀ/√d) - λ softmax(Q2 K2ᵀ/√d)) V with λ = exp(λq1·λk1) - exp(λq2·λk2) +
    λ_init, λ_init = 0.8 - 0.6 exp(-0.3 (l - 1)) at layer l; each head's output RMS-normalised and scaled by
    1 - λ_init (unless `differential_head_norm` is False). Map i of head h reads map i of key/value head
    h // (H / G); ALiBi biases both maps."""
    batch, length, _ = hidden.shape
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim // 2  # a map's width
    q = attn.q_proj(hidden).view(batch, length, 2 * heads, d)  # map i of head h at 2h + i
    k = attn.k_proj(hidden).view(batch, length, 2 * kv_heads, d)
    v = attn.v_proj(hidden).view(batch, length, kv_heads, 2 * d)
    if config.position_embedding_type == "rope":
        theta = config.rope_parameters["rope_theta"]
        q, k = rotate(q, positions, theta), rotate(k, positions, theta)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * attn.layer_idx)  # layer l = layer_idx + 1
    lam = torch.exp(attn.lambda_q1 @ attn.lambda_k1) - torch.exp(attn.lambda_q2 @ attn.lambda_k2) + lambda_init
    slopes = paper_alibi_slopes(heads)
    out = torch.zeros(batch, length, heads, 2 * d)
    # an encoder (`causal=False`) lets every real key in, and ALiBi reads the distance either way
    order = torch.ones(length, length, dtype=torch.bool)
    order = order.tril() if causal else order
    for b in range(batch):
        allowed = order & attention_mask[b].bool()[None, :]
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                if not allowed[i].any():  # a padding query: its output is never compared
                    continue
                maps = []
                for m in (0, 1):
                    scores = k[b, :, 2 * g + m] @ q[b, i, 2 * h + m] / math.sqrt(d)
                    if config.position_embedding_type == "alibi":
                        scores = scores - slopes[h] * alibi_distance(positions[b, i] - positions[b], causal)
                    maps.append(scores.masked_fill(~allowed[i], float("-inf")).softmax(-1))
                head = (maps[0] - lam * maps[1]) @ v[b, :, g]  # (2d,)
                if not config.differential_head_norm:  # the paper's ablation: the head's output as it is
                    out[b, i, h] = head
                    continue
                normed = head / torch.sqrt((head**2).mean() + config.rms_norm_eps) * attn.head_norm.weight
                out[b, i, h] = normed * (1 - lambda_init)
    return attn.o_proj(out.reshape(batch, length, heads * 2 * d))


def linformer_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Wang et al. 2020, causal form: at step t slot j holds sum over real tokens s <= t of E[j, pos_s]·k_s (F for
    values), and the query attends over the k slots; with `is_causal=False` (or as an encoder, `causal=False`) the
    sums run over the whole input, the paper's form."""
    batch, length, _ = hidden.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = attn.q_proj(hidden).view(batch, length, heads, head_dim)
    k = attn.k_proj(hidden).view(batch, length, kv_heads, head_dim)
    v = attn.v_proj(hidden).view(batch, length, kv_heads, head_dim)
    if config.position_embedding_type == "rope":
        theta = config.rope_parameters["rope_theta"]
        q, k = rotate(q, positions, theta), rotate(k, positions, theta)
    projection = attn.linformer_projection
    e = projection.key_projection
    f = e if projection.value_projection is None else projection.value_projection
    out = torch.zeros(batch, length, heads, head_dim)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            p = g if e.shape[0] > 1 else 0  # one E per key/value head, or shared
            for t in range(length):
                if not attention_mask[b, t]:
                    continue
                horizon = t + 1 if config.is_causal and causal else length
                slots_k = torch.zeros(config.linformer_k, head_dim)
                slots_v = torch.zeros(config.linformer_k, head_dim)
                for s in range(horizon):
                    if attention_mask[b, s]:
                        slots_k += e[p, :, positions[b, s], None] * k[b, s, g]
                        slots_v += f[p, :, positions[b, s], None] * v[b, s, g]
                probabilities = (slots_k @ q[b, t, h] / head_dim**0.5).softmax(-1)
                out[b, t, h] = probabilities @ slots_v
    return attn.o_proj(out.reshape(batch, length, heads * head_dim))


def aft_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Zhai et al. 2021, causal, in float64: y_t = sigmoid(q_t) * sum_{s <= t} exp(k_s + w_ts) v_s / sum of the
    weights, with w_ts = u[pos_t]·v[pos_s] (AFT-full), the same only when pos_t - pos_s < window and 0 otherwise
    (AFT-local), and 0 (AFT-simple). Padding tokens take no part. As an encoder (`causal=False`) the sums run over
    every token and AFT-local's window is two-sided, |pos_t - pos_s| < window."""
    batch, length, width = hidden.shape
    q, k, v = attn.q_proj(hidden), attn.k_proj(hidden).double(), attn.v_proj(hidden).double()
    out = torch.zeros(batch, length, width, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            if not attention_mask[b, t]:
                continue
            numerator = torch.zeros(width, dtype=torch.float64)
            denominator = torch.zeros(width, dtype=torch.float64)
            for s in range(t + 1 if causal else length):
                if not attention_mask[b, s]:
                    continue
                w = 0.0
                distance = positions[b, t] - positions[b, s]
                near = config.aft_mode == "local" and (distance if causal else abs(distance)) < config.aft_window
                if config.aft_mode == "full" or near:
                    u_t = attn.position_bias_u.weight[positions[b, t]].double()
                    w = u_t @ attn.position_bias_v.weight[positions[b, s]].double()
                weight = torch.exp(k[b, s] + w)
                numerator += weight * v[b, s]
                denominator += weight
            out[b, t] = torch.sigmoid(q[b, t]).double() * numerator / denominator
    return attn.o_proj(out.float())


def linear_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """Katharopoulos et al. 2020, section 3, one (row, head, query) at a time in float64: y_t = φ(q_t)ᵀ
    Σ_s φ(k_s) v_sᵀ / (φ(q_t)ᵀ Σ_s φ(k_s) + ε), φ(x) = elu(x) + 1 (or, with `feature_map="hedgehog"`, each head's
    [softmax(xW), softmax(-xW)] written out as exponentials), no scale, over the real tokens s <= t (every real token
    as an encoder, `causal=False`); query head h reads key/value head h // (H / G)."""
    batch, length, _ = hidden.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def phi(x, maps):  # x: (B, T, heads, d)
        if maps is None:
            return torch.where(x > 0, x + 1, torch.exp(x))  # elu(x) + 1 written out
        projected = torch.einsum("bthd,hde->bthe", x, maps.double())
        plus, minus = torch.exp(projected), torch.exp(-projected)
        return torch.cat((plus / plus.sum(-1, keepdim=True), minus / minus.sum(-1, keepdim=True)), dim=-1)

    q = phi(attn.q_proj(hidden).view(batch, length, heads, head_dim).double(), attn.query_feature_map)
    k = phi(attn.k_proj(hidden).view(batch, length, kv_heads, head_dim).double(), attn.key_feature_map)
    v = attn.v_proj(hidden).view(batch, length, kv_heads, head_dim).double()
    out = torch.zeros(batch, length, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            for t in range(length):
                if not attention_mask[b, t]:  # a padding query: its output is never compared
                    continue
                numerator = torch.zeros(head_dim, dtype=torch.float64)
                denominator = torch.zeros((), dtype=torch.float64)
                for s in range(t + 1 if causal else length):
                    if attention_mask[b, s]:
                        similarity = q[b, t, h] @ k[b, s, g]
                        numerator += similarity * v[b, s, g]
                        denominator += similarity
                out[b, t, h] = numerator / (denominator + config.linear_attention_eps)
    return attn.o_proj(out.float().reshape(batch, length, heads * head_dim))


def bigbird_hash(seed: int, layer: int, head: int, query_block: int, key_block: int) -> int:
    """The random blocks' hash of (seed, layer, head, query block, key block), in Python integers: each step maps
    x, v to ((x xor v)·1103515245 + 12345) mod (2^31 - 1), then x xor (x >> 16), then (x·69069 + 1) mod (2^31 - 1)."""
    modulus = 2**31 - 1
    state = seed
    for value in (layer, head, query_block, key_block):
        state = ((state ^ value) * 1103515245 + 12345) % modulus
        state ^= state >> 16
        state = (state * 69069 + 1) % modulus
    return state


def bigbird_blocks(config, layer: int, head: int, query_block: int, blocks: int | None, causal: bool) -> set[int]:
    """Zaheer et al. 2020: the key blocks query block i attends to. Causal: the window i - w + 1 .. i, the first g
    blocks up to i, and the r candidates among g .. i - w with the smallest (hash, block). Bidirectional (ITC) in a
    row of `blocks` blocks: the window i - (w - 1)/2 .. i + (w - 1)/2, the first ceil(g/2) and the last floor(g/2)
    blocks, and r random blocks among the others."""
    w, g, r = config.num_window_blocks, config.num_global_blocks, config.num_random_blocks
    seed = config.random_blocks_seed
    if causal:
        chosen = {j for j in range(query_block - w + 1, query_block + 1) if j >= 0}
        chosen |= {j for j in range(g) if j <= query_block}
        candidates = [j for j in range(query_block + 1) if j not in chosen]
    else:
        half, front, back = (w - 1) // 2, (g + 1) // 2, g // 2
        chosen = {j for j in range(query_block - half, query_block + half + 1) if 0 <= j < blocks}
        chosen |= {j for j in range(front) if j < blocks} | {j for j in range(blocks - back, blocks) if j >= 0}
        candidates = [j for j in range(blocks) if j not in chosen]
    candidates.sort(key=lambda j: (bigbird_hash(seed, layer, head, query_block, j), j))
    return chosen | set(candidates[:r])


def bigbird_attention(attn, hidden, positions, attention_mask, config, causal=True):
    """BigBird's block-sparse attention as dense softmax attention under its explicit block mask, one (row, head,
    query) at a time: query at position p (block p // b) sees the real keys of its document whose blocks
    `bigbird_blocks` lists (causal: at positions <= p); in the bidirectional form the queries of the global blocks
    see every real key of the row. Documents of a packed row start where the positions restart at 0."""
    batch, length, _ = hidden.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    size = config.attention_block_size
    q = attn.q_proj(hidden).view(batch, length, heads, head_dim)
    k = attn.k_proj(hidden).view(batch, length, kv_heads, head_dim)
    v = attn.v_proj(hidden).view(batch, length, kv_heads, head_dim)
    if config.position_embedding_type == "rope":
        theta = config.rope_parameters["rope_theta"]
        q, k = rotate(q, positions, theta), rotate(k, positions, theta)
    out = torch.zeros(batch, length, heads, head_dim)
    for b in range(batch):
        real = attention_mask[b].bool()
        documents = torch.cumsum((positions[b] == 0) & real, 0)  # a document starts at each real position 0
        blocks = math.ceil(int(real.sum()) / size)  # the bidirectional form reads one document per row
        front, back = (config.num_global_blocks + 1) // 2, config.num_global_blocks // 2
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                if not real[i]:  # a padding query: its output is never compared
                    continue
                query_block = int(positions[b, i]) // size
                every = not causal and (query_block < front or query_block >= blocks - back)
                allowed = torch.zeros(length, dtype=torch.bool)
                pattern = bigbird_blocks(config, attn.layer_idx, h, query_block, blocks, causal)
                for j in range(length):
                    if not real[j] or documents[j] != documents[i]:
                        continue
                    if causal and positions[b, j] > positions[b, i]:
                        continue
                    allowed[j] = every or int(positions[b, j]) // size in pattern
                scores = k[b, :, g] @ q[b, i, h] * head_dim**-0.5
                out[b, i, h] = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[b, :, g]
    return attn.o_proj(out.reshape(batch, length, heads * head_dim))


def mamba_mixer(mixer, hidden, positions, attention_mask, config, causal=True):
    """Gu & Dao 2023, Algorithm 2, one row and one token at a time in float64: x, z = in_proj(u); x_t =
    act(Σ_j w_j x_{t-k+1+j} + b) over the row's real tokens (earlier ones are zeros); Δ_t = softplus(dt_proj(x_t
    W_Δ)), B_t = x_t W_B, C_t = x_t W_C; h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t with A = -exp(A_log); y_t = C_t h_t +
    D x_t, gated by silu(z_t). Padding tokens are skipped (their outputs are never compared). Causal only: Mamba has
    no bidirectional form."""
    assert causal, "Mamba-1 has no bidirectional form"
    batch, length, _ = hidden.shape
    rank, states, kernel = config.time_step_rank, config.state_size, config.conv_kernel
    projected = mixer.in_proj(hidden).double()
    x_all, z_all = projected.chunk(2, dim=-1)  # (B, T, D) each
    weight = mixer.conv1d.weight[:, 0].double()  # (D, k)
    bias = mixer.conv1d.bias.double() if mixer.conv1d.bias is not None else 0.0
    x_proj, dt_weight = mixer.x_proj.weight.double(), mixer.dt_proj.weight.double()
    dt_bias = mixer.dt_proj.bias.double()
    A, D = -torch.exp(mixer.A_log.double()), mixer.D.double()
    act = torch.nn.functional.silu
    out = torch.zeros(batch, length, config.intermediate_size, dtype=torch.float64)
    for b in range(batch):
        real = [t for t in range(length) if attention_mask[b, t]]
        h = torch.zeros(config.intermediate_size, states, dtype=torch.float64)
        for i, t in enumerate(real):
            window = [real[i - kernel + 1 + j] if i - kernel + 1 + j >= 0 else None for j in range(kernel)]
            conv = sum(weight[:, j] * x_all[b, s] for j, s in enumerate(window) if s is not None) + bias
            x = act(conv)
            parameters = x_proj @ x
            time_step, B, C = parameters[:rank], parameters[rank : rank + states], parameters[rank + states :]
            delta = torch.nn.functional.softplus(dt_weight @ time_step + dt_bias)  # (D,)
            h = torch.exp(delta[:, None] * A) * h + (delta[:, None] * B[None, :]) * x[:, None]
            out[b, t] = (h @ C + D * x) * act(z_all[b, t])
    return mixer.out_proj(out.float())


def residual(x: torch.Tensor, norm, branch, config) -> torch.Tensor:
    """One residual branch: pre-norm `x + f(norm(x))` (GPT-2, Llama), or post-norm `norm(x + f(x))` (Vaswani et al.
    2017, section 3.1: LayerNorm(x + Sublayer(x)))."""
    if config.norm_position == "post":
        return norm(x + branch(x))
    return x + branch(norm(x))


def causal_lm_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, attention=softmax_attention):
    """Logits of a zoo model recomputed layer by layer with the naive `attention` and true positions."""
    config = model.config
    positions = true_positions(attention_mask)
    x = model.model.embed_tokens.weight[input_ids]
    if config.scale_embedding:  # Vaswani et al. 2017, section 3.4: embeddings times sqrt(d)
        x = x * config.hidden_size**0.5
    if config.position_embedding_type == "learned":
        x = x + model.model.embed_positions(positions)
    elif config.position_embedding_type == "sinusoidal":  # of the config's amplitude
        x = x + config.sinusoid_amplitude * sinusoid(positions, config.hidden_size)
    for layer in model.model.layers:
        mixer = partial(attention, layer.self_attn, positions=positions, attention_mask=attention_mask, config=config)
        x = residual(x, layer.input_layernorm, mixer, config)
        if layer.mlp is not None:  # `mlp_type="none"` (Mamba's blocks) has none
            x = residual(x, layer.post_attention_layernorm, layer.mlp, config)
    return model.lm_head(model.model.norm(x))


def cross_attention(attn, hidden, memory, memory_mask):
    """A decoder's cross-attention written out, one (row, head, query) at a time: query head h reads the encoder
    key/value head h // (H / G); the score is the scaled dot product, or Bahdanau's v_h . tanh(q + k) for the additive
    kind (`score_vector`); padded source tokens are never attended to; no positions."""
    batch, length, _ = hidden.shape
    source_length = memory.shape[1]
    heads, kv_heads, width, head_dim = attn.num_heads, attn.num_key_value_heads, attn.query_key_dim, attn.head_dim
    q = attn.q_proj(hidden).view(batch, length, heads, width)
    k = attn.k_proj(memory).view(batch, source_length, kv_heads, width)
    v = attn.v_proj(memory).view(batch, source_length, kv_heads, head_dim)
    additive = hasattr(attn, "score_vector")
    out = torch.zeros(batch, length, heads, head_dim)
    for b in range(batch):
        real = memory_mask[b].bool()
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                if additive:
                    scores = torch.stack(
                        [attn.score_vector[h] @ torch.tanh(q[b, i, h] + k[b, j, g]) for j in range(source_length)]
                    )
                else:
                    scores = k[b, :, g] @ q[b, i, h] * head_dim**-0.5
                probabilities = scores.masked_fill(~real, float("-inf")).softmax(-1)
                out[b, i, h] = probabilities @ v[b, :, g]
    return attn.o_proj(out.reshape(batch, length, heads * head_dim))


def seq2seq_logits(model, input_ids, attention_mask, decoder_input_ids, attention=softmax_attention):
    """Logits of a zoo encoder-decoder recomputed layer by layer: the encoder with the naive `attention` in its
    bidirectional form, the decoder with it causal and the naive cross-attention over the encoder's outputs. True
    positions on both sides (the decoder's target is unpadded)."""
    config = model.config

    def embed(stack, ids, positions):
        x = stack.embed_tokens(ids)  # scaled where the backbone scales it
        if config.position_embedding_type == "learned":
            x = x + stack.embed_positions(positions)
        elif config.position_embedding_type == "sinusoidal":
            x = x + config.sinusoid_amplitude * sinusoid(positions, config.hidden_size)
        return x

    encoder, decoder = model.model.encoder, model.model.decoder
    positions = true_positions(attention_mask)
    x = embed(encoder, input_ids, positions)
    for layer in encoder.layers:
        mixer = partial(
            attention, layer.self_attn, positions=positions, attention_mask=attention_mask, config=config, causal=False
        )
        x = residual(x, layer.input_layernorm, mixer, config)
        x = residual(x, layer.post_attention_layernorm, layer.mlp, config)
    memory = encoder.norm(x)
    target_mask = torch.ones_like(decoder_input_ids)
    positions = true_positions(target_mask)
    y = embed(decoder, decoder_input_ids, positions)
    for layer in decoder.layers:
        mixer = partial(attention, layer.self_attn, positions=positions, attention_mask=target_mask, config=config)
        y = residual(y, layer.input_layernorm, mixer, config)
        reader = partial(cross_attention, layer.encoder_attn, memory=memory, memory_mask=attention_mask)
        y = residual(y, layer.encoder_attn_layer_norm, reader, config)
        y = residual(y, layer.post_attention_layernorm, layer.mlp, config)
    return model.lm_head(decoder.norm(y))


# --- the RNN translator (`zoo_rnn`): cells stepped by hand, one row and one position at a time -----------------


def rnn_cell_of(rnn: torch.nn.RNNBase, layer: int, reverse: bool = False) -> torch.nn.RNNCellBase:
    """The `torch.nn.GRUCell`/`LSTMCell` holding one layer (and direction) of `rnn`'s weights."""
    suffix = f"_l{layer}" + ("_reverse" if reverse else "")
    input_size = rnn.input_size if layer == 0 else rnn.hidden_size * (2 if rnn.bidirectional else 1)
    cell = (torch.nn.LSTMCell if isinstance(rnn, torch.nn.LSTM) else torch.nn.GRUCell)(input_size, rnn.hidden_size)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(cell, name).data.copy_(getattr(rnn, name + suffix))
    return cell


def rnn_cell_step(cell: torch.nn.RNNCellBase, x: torch.Tensor, state):
    """One cell step on one row; the state is h (GRU) or (h, c) (LSTM)."""
    if isinstance(cell, torch.nn.LSTMCell):
        h, c = cell(x[None], (state[0][None], state[1][None]))
        return h[0], (h[0], c[0])
    h = cell(x[None], state[None])[0]
    return h, h


def rnn_encoder(model, tokens: list[int]) -> torch.Tensor:
    """The encoder outputs (n, E) of one source without padding."""
    config, rnn = model.config, model.model.encoder.rnn
    zeros = torch.zeros(config.rnn_hidden_size)
    layer_inputs = [model.model.shared.weight[token] for token in tokens]
    for layer in range(config.num_layers):
        directions = []
        for reverse in (False, True)[: 1 + config.bidirectional_encoder]:
            cell = rnn_cell_of(rnn, layer, reverse)
            state = (zeros, zeros) if config.cell == "lstm" else zeros
            outputs = []
            for x in reversed(layer_inputs) if reverse else layer_inputs:
                h, state = rnn_cell_step(cell, x, state)
                outputs.append(h)
            directions.append(outputs[::-1] if reverse else outputs)
        layer_inputs = [torch.cat(states) for states in zip(*directions)]
    return torch.stack(layer_inputs)


def rnn_logits(model, source: list[int], target: list[int]) -> torch.Tensor:
    """Logits (T, V) of one source/target pair, every formula written out."""
    config, decoder = model.config, model.model.decoder
    size, layers = config.rnn_hidden_size, config.num_layers
    memory = rnn_encoder(model, source)  # (n, E)
    summary = memory[-1, :size]
    if config.bidirectional_encoder:  # the forward direction's last state, the backward direction's first
        summary = torch.cat([summary, memory[0, size:]])
    hidden = torch.tanh(decoder.bridge.weight @ summary + decoder.bridge.bias).view(layers, size)
    states = list(hidden)
    if config.cell == "lstm":
        cells = (decoder.bridge_cell.weight @ summary + decoder.bridge_cell.bias).view(layers, size)
        states = list(zip(hidden, cells))
    layer_cells = [rnn_cell_of(decoder.rnn, layer) for layer in range(layers)]

    def attend(scores: list[torch.Tensor]) -> torch.Tensor:
        weights = torch.softmax(torch.stack(scores), dim=0)
        return sum(weight * h_j for weight, h_j in zip(weights, memory))

    logits = []
    for token in target:
        x = model.model.shared.weight[token]
        top = states[-1][0] if config.cell == "lstm" else states[-1]
        if config.attention == "bahdanau":  # e_tj = v^T tanh(W s_{t-1} + U h_j), the context into the RNN
            attention = decoder.encoder_attn
            scores = [
                attention.v.weight[0] @ torch.tanh(attention.query_proj.weight @ top + attention.key_proj.weight @ h_j)
                for h_j in memory
            ]
            context = attend(scores)
            x = torch.cat([x, context])
        for layer in range(layers):
            x, states[layer] = rnn_cell_step(layer_cells[layer], x, states[layer])
        s = x
        if config.attention == "luong":  # e_tj = s_t^T W_a h_j, after the step
            context = attend([s @ (decoder.encoder_attn.key_proj.weight @ h_j) for h_j in memory])
        features = s if config.attention == "none" else torch.cat([context, s])
        attentional = torch.tanh(decoder.output_proj.weight @ features + decoder.output_proj.bias)
        logits.append(model.lm_head.weight @ attentional)
    return torch.stack(logits)
