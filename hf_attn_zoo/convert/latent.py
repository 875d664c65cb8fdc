"""MHA / GQA / MQA -> multi-head latent attention (`zoo_mla`) without training, after TransMLA and MHA2MLA.

A model with H query heads reading G key/value heads of width d (RoPE pairing channel i with i + d/2, frequency i)
becomes an MLA model whose cache holds `kv_lora_rank` latent values and one `qk_rope_head_dim`-wide RoPE key per
token and layer, instead of 2·G·d. Per layer:

1. **Rotate across key heads, per frequency** (TransMLA's RoRoPE, Meng et al. 2025). For frequency f, the G heads'
   keys on its plane form a G x 2 block; mixing the heads by an orthogonal G x G matrix U_f (the same on both
   coordinates) commutes with the rotation RoPE applies to the plane, and the queries take U_f too (query head h's
   coefficient for mixed component j is U_f[g(h), j]), so every score is unchanged. `method="rorope"` takes U_f from
   the principal axes of the heads' keys on the calibration text (largest first), so the first component carries as
   much of the keys as one head can; `method="mean"` takes the heads' mean as the first component (the direction
   mean pooling keeps), with no fit.
2. **Keep RoPE on the first component of the most important frequencies** (MHA2MLA's partial RoPE, Ji et al. 2025):
   `qk_rope_head_dim / 2` frequencies ranked by the 2-norm criterion, the sum over query heads of ||q_f||·||k_f||
   of the first component. That component on those frequencies is the shared RoPE key; the queries' matching
   channels become the heads' RoPE queries. Deviation: the norms are root-mean-square over the calibration tokens
   (what the input covariance gives) rather than MHA2MLA's mean of per-token norms, and one choice serves all heads
   (the RoPE key is shared) where MHA2MLA chooses per head.
3. **Everything else loses RoPE** (the approximation): the other components on every frequency, and the first on
   the frequencies not kept, are no-RoPE keys shared by all heads, each head keeping its own query coefficients.
4. **Joint low-rank latent** (MHA2MLA's joint SVD of keys and values): the no-RoPE key rows and the value rows,
   stacked as M, are reduced to their `kv_lora_rank` leading directions U_r under the input covariance Σ of the
   calibration text (the eigenvectors of M Σ Mᵀ; without calibration, Σ = I, the plain SVD of M): the latent is
   c = U_rᵀ M x, keys and values are read back as U_r c. The key read-back is folded into the queries (no-RoPE query
   width `kv_lora_rank`, `kv_b_proj`'s key part the identity); the value read-back of head h's group is its `kv_b_proj`
   value part. The latent has no norm (`latent_norm=False`): a norm is not linear in the parent's keys.

The queries are rescaled so that MLA's 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) gives the parent's 1/sqrt(d);
`o_proj`, the MLP, the norms and the embeddings are copied. Exact where it must be: with every frequency kept and the
latent at full rank, a model whose key heads are identical (or an MQA model) converts without changing its function.
TransMLA also keeps one head's worth of RoPE (all frequencies, `qk_rope_head_dim = head_dim`, the default here).
"""

import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..models import ZooForCausalLM, get_variant
from .calibrated import calibration_batches, check_enough, run_hooked
from .llama import from_llama, in_mha_family

MLA_METHODS = ("rorope", "mean")


@torch.no_grad()
def input_covariances(model: ZooForCausalLM, batches: list[torch.LongTensor]) -> list[torch.Tensor]:
    """Per layer, the second moment `Σ = E[x xᵀ]` `(D, D)` (float64) of the attention's input over the calibration
    tokens, accumulated by hooks during plain forwards."""
    sums: list[torch.Tensor | None] = [None] * len(model.model.layers)
    count = [0]

    def attach(index: int, layer: nn.Module) -> list[RemovableHandle]:
        def accumulate(module, args, kwargs):
            x = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).reshape(
                -1, model.config.hidden_size
            )  # (B, T, D) -> (B T, D)
            x = x.double()
            sums[index] = x.T @ x if sums[index] is None else sums[index] + x.T @ x
            if index == 0:
                count[0] += x.shape[0]

        return [layer.self_attn.register_forward_pre_hook(accumulate, with_kwargs=True)]

    run_hooked(model, batches, attach)
    return [total.cpu() / count[0] for total in sums]


def mean_first_basis(groups: int) -> torch.Tensor:
    """An orthonormal `(G, G)` basis whose first column is the heads' mean direction, ones / sqrt(G)."""
    basis, _ = torch.linalg.qr(torch.cat((torch.ones(groups, 1), torch.eye(groups)[:, 1:]), dim=1).double())
    return basis * basis[0, 0].sign()  # QR may return the first column negated


def latent_attention(
    weights: dict[str, torch.Tensor],
    covariance: torch.Tensor,
    heads: int,
    groups: int,
    head_dim: int,
    rank: int,
    rope_pairs: int,
    method: str,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One layer (module docstring): the parent's `q_proj`/`k_proj`/`v_proj`/`o_proj` weights -> the MLA layer's
    `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`, and the frequencies that keep RoPE."""
    half = head_dim // 2
    hidden = weights["q_proj.weight"].shape[1]
    # rows of a head are channels c * d/2 + f: coordinate c in {0, 1} of frequency f's plane
    query = weights["q_proj.weight"].double().view(heads, 2, half, hidden)  # (H, 2, d/2, D)
    key = weights["k_proj.weight"].double().view(groups, 2, half, hidden)  # (G, 2, d/2, D)
    value = weights["v_proj.weight"].double()  # (G * d, D)
    sigma = covariance.double()

    # 1. mix the key heads per frequency: U (d/2, G, G), column j the j-th component
    if method == "rorope":
        weighted = torch.einsum("gcfd,de->gcfe", key, sigma)
        moments = torch.einsum("gcfe,hcfe->fgh", weighted, key)  # (d/2, G, G): the heads' key covariance per plane
        mixing = torch.linalg.eigh(moments).eigenvectors.flip(-1)  # largest first
    else:
        mixing = mean_first_basis(groups).expand(half, groups, groups)
    key = torch.einsum("fgj,gcfd->jcfd", mixing, key)  # (G components, 2, d/2, D)
    group_of = torch.arange(heads) // (heads // groups)
    query = torch.einsum("fhj,hcfd->hjcfd", mixing[:, group_of, :], query)  # (H, G components, 2, d/2, D)

    # 2. the frequencies whose first component keeps RoPE: sum over heads of RMS ||q_f|| * RMS ||k_f||
    key_norm = torch.einsum("cfd,de,cfe->f", key[0], sigma, key[0]).clamp(min=0).sqrt()  # (d/2,)
    query_norm = torch.einsum("hcfd,de,hcfe->hf", query[:, 0], sigma, query[:, 0]).clamp(min=0).sqrt()  # (H, d/2)
    kept = (query_norm * key_norm).sum(0).topk(rope_pairs).indices.sort().values  # (rope/2,)
    rope = torch.zeros(groups, 2, half, dtype=torch.bool)
    rope[0, :, kept] = True
    key_rope = key[0][:, kept].reshape(-1, hidden)  # (2 * rope/2, D): coordinate-major, as the RoPE part pairs them
    query_rope = query[:, 0][:, :, kept].reshape(heads, -1, hidden)  # (H, rope, D)

    # 3. everything else is a no-RoPE key shared by all heads, with each head's query coefficients
    key_nope = key[~rope]  # (D_n, D), D_n = G * d - rope
    query_nope = query[:, ~rope]  # (H, D_n, D)

    # 4. the joint low-rank latent of no-RoPE keys and values under the input covariance
    stacked = torch.cat((key_nope, value))  # (D_n + G * d, D)
    directions = torch.linalg.eigh(stacked @ sigma @ stacked.T).eigenvectors.flip(-1)[:, :rank]  # (D_n + G d, r)
    down = directions.T @ stacked  # (r, D): the latent c = down x
    read_keys, read_values = directions[: key_nope.shape[0]], directions[key_nope.shape[0] :]
    query_latent = torch.einsum("nr,hnd->hrd", read_keys, query_nope)  # (H, r, D): q_nopeᵀ (read_keys c)
    # MLA scales scores by 1/sqrt(r + rope); the parent by 1/sqrt(d)
    scale = math.sqrt(rank + 2 * rope_pairs) / math.sqrt(head_dim)
    up_values = read_values.reshape(groups, head_dim, rank)[group_of]  # (H, d, r): head h reads its group's values
    up_keys = torch.eye(rank, dtype=torch.float64).expand(heads, rank, rank)  # folded into the queries
    converted = {
        "q_proj.weight": torch.cat((query_latent, query_rope), dim=1).reshape(-1, hidden) * scale,
        "kv_a_proj_with_mqa.weight": torch.cat((down, key_rope)),
        "kv_b_proj.weight": torch.cat((up_keys, up_values), dim=1).reshape(-1, rank),
        "o_proj.weight": weights["o_proj.weight"],
    }
    return converted, kept.tolist()


def to_mla(
    model,
    kv_lora_rank: int,
    qk_rope_head_dim: int | None = None,
    method: str = "rorope",
    calibration=None,
    tokenizer=None,
    max_calibration_tokens: int | None = None,
) -> ZooForCausalLM:
    """A `zoo_mla` model converted from `model` (a zoo MHA-family model with RoPE, or a transformers Llama / Mistral /
    Qwen2 model, converted first): a latent of `kv_lora_rank` and a shared RoPE key of `qk_rope_head_dim` (default
    the parent's head_dim, every frequency) per token and layer (module docstring). `calibration` (texts with the
    model's `tokenizer`, a `(B, T)` tensor or id sequences; optional) weighs every fit by what the layers see; without
    it the fits read the weights alone."""
    if method not in MLA_METHODS:
        raise ValueError(f"method={method!r}: use one of {MLA_METHODS}.")
    if not isinstance(model, ZooForCausalLM):
        model = from_llama(model)
    config = model.config
    if not in_mha_family(config.model_type):
        raise ValueError(
            f"{config.model_type} is not in the MHA family (mha, gqa, mqa, single_head): it has no key and value "
            f"projections to compress into a latent."
        )
    if config.position_embedding_type != "rope":
        raise ValueError(
            f"position_embedding_type={config.position_embedding_type!r}: the conversion splits RoPE frequencies "
            f"between a shared RoPE key and the latent, so it needs a RoPE model."
        )
    if config.attention_bias:
        raise ValueError(
            "attention_bias=True: the latent is a linear map of the input; convert a model without biases."
        )
    heads, groups, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rope_width = head_dim if qk_rope_head_dim is None else qk_rope_head_dim
    if not isinstance(rope_width, int) or rope_width < 2 or rope_width % 2 or rope_width > head_dim:
        raise ValueError(
            f"qk_rope_head_dim={qk_rope_head_dim!r} must be an even number of channels from 2 to head_dim={head_dim}: "
            f"the RoPE key keeps qk_rope_head_dim / 2 of the parent's {head_dim // 2} frequencies."
        )
    full_rank = 2 * groups * head_dim - rope_width  # no-RoPE key rows and value rows
    if not isinstance(kv_lora_rank, int) or not 1 <= kv_lora_rank <= full_rank:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank!r} must be from 1 to {full_rank}, the rows of no-RoPE keys and values it "
            f"compresses (2 x num_key_value_heads x head_dim - qk_rope_head_dim); the cache then holds kv_lora_rank "
            f"+ qk_rope_head_dim values per token per layer, against {2 * groups * head_dim} before."
        )
    if calibration is not None:
        batches = calibration_batches(calibration, tokenizer, config.max_position_embeddings, max_calibration_tokens)
        check_enough(sum(batch.numel() for batch in batches), head_dim)
        covariances = input_covariances(model, batches)
    else:
        covariances = [torch.eye(config.hidden_size, dtype=torch.float64)] * config.num_hidden_layers

    state = model.state_dict()
    converted, frequencies = {}, []
    for index, covariance in enumerate(covariances):
        prefix = f"model.layers.{index}.self_attn."
        weights = {name[len(prefix) :]: state.pop(name) for name in list(state) if name.startswith(prefix)}
        layer, kept = latent_attention(
            weights, covariance, heads, groups, head_dim, kv_lora_rank, rope_width // 2, method
        )
        converted.update({prefix + name: tensor.to(model.dtype) for name, tensor in layer.items()})
        frequencies.append(kept)

    mla = get_variant("mla")
    fields = {
        key: value
        for key, value in config.to_dict().items()
        if key in mla.config_class.__dataclass_fields__
        and key not in ("architectures", "model_type", "num_key_value_heads", "auto_map")
    }
    new_config = mla.config(
        **fields,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=kv_lora_rank,
        qk_rope_head_dim=rope_width,
        v_head_dim=head_dim,
        rope_frequencies=frequencies,
        latent_norm=False,
    )
    backend = config._attn_implementation
    new_config._attn_implementation = backend if backend in mla.backends else mla.default_backend
    latent = mla.causal_lm_class(new_config)
    latent.load_state_dict({**state, **converted}, strict=True)
    return latent.to(model.dtype).train(model.training)
