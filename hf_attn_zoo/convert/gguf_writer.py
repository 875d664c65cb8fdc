"""Zoo checkpoints as GGUF files that llama.cpp (and ollama, llama-cpp-python) run, written with the `gguf` package.

Four llama.cpp architectures hold zoo variants (the attention class's `gguf_architecture`): `llama` for the MHA family
(grouped key/value heads through `head_count_kv`), `granite_swa` for the sliding window, `deepseek2` for MLA (every
layer dense: `leading_dense_block_count` = the layer count; the latent up-projected by `attn_kv_b`, llama.cpp's path
without absorption), and `mamba` for the Mamba mixer (`ssm_*` tensors and metadata, blocks without an MLP).
llama.cpp's `llama` ignores `sliding_window` (measured: it attends over the whole context); `granite_swa` is Llama's
layout with llama.cpp's standard window (a key at distance >= `sliding_window` is masked: w keys, the query's own
included, as transformers' mask) on the layers its pattern marks, here all of them, with a logit scale of 1 and
per-head attention sinks of -1e30 (a sink adds exp(sink) to the softmax's denominator: nothing).
Tensor names and metadata keys come from the `gguf` package's constants (`MODEL_TENSOR`, `GGUFWriter.add_*`), and
three of llama.cpp's conventions matter for the numbers:

- RoPE: llama.cpp's `llama`, `granite_swa` and `deepseek2` rotate adjacent channel pairs (2i, 2i + 1), the zoo
  pairs i with i + d/2. The rows producing rotated channels (a head's rows of `q_proj` and `k_proj` and their
  biases; MLA's RoPE rows of the queries and of `kv_a_proj_with_mqa`) are reordered so that llama.cpp's pairs are
  the zoo's: row 2i + j of a rotated block is row j·d/2 + i of the original.
- Mamba: llama.cpp stores A itself, not its logarithm (`ssm_a` = -exp(`A_log`)), and the depthwise convolution's
  weight as a (channels, kernel) matrix (`conv1d.weight` is (channels, 1, kernel)); `ssm_a` and `ssm_d` carry no
  ".weight" suffix. llama.cpp's mamba always has a convolution bias (zeros are written where `use_conv_bias=False`),
  never a bias on `in_proj` / `out_proj`, and applies SiLU after the convolution.
- Types: f32 keeps every tensor in float32; f16 stores matrices in float16 and keeps the norms' vectors in float32,
  as llama.cpp's own converter does; q8_0 quantises matrices whose rows are a multiple of its 32-value block and
  stores the others in float16. Mamba's convolution weight and A stay float32 at every type, as llama.cpp's
  converter keeps them (its convolution and scan kernels read float32).

The tokenizer goes into the file too, so llama.cpp tokenizes as the checkpoint's tokenizer does: the zoo's byte-level
BPE is GPT-2's scheme (`tokenizer.ggml.model = "gpt2"`, pre-tokenizer `gpt-2`, the same regular expression), with its
tokens, merges, token types (special tokens are control tokens) and BOS / EOS / padding ids. A tokenizer llama.cpp
would split differently (another model, a normaliser, no GPT-2 regular expression with merges) is refused.

What else is refused, naming the field: a position type other than RoPE, a norm other than RMSNorm, an MLP other than
the gated one, an activation other than SiLU, RoPE scaling; for MLA, biases (`deepseek2` has none), a latent without
its norm and per-layer RoPE frequencies (a converted MLA), and no RoPE-free query part; for Mamba, what transformers'
`MambaForCausalLM` cannot hold either (`mamba_refusal`: positions, post-norm, an MLP, a scaled embedding),
`use_bias=True`, an activation other than SiLU and a mixer width other than 2 · `hidden_size` (llama.cpp loads no other
expansion); and every variant llama.cpp has no architecture for (reasons in `gguf_refusal`). Mamba's `time_step_*`
fields and `scan_chunk_size` are not refused: they set the initial Δ and how the zoo's scan is chunked, not the
function a trained model computes.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..models import get_variant
from .llama import LLAMA_BACKBONE
from .mamba import mamba_refusal

GGUF_DTYPES = ("f32", "f16", "q8_0")
Q8_0_BLOCK = 32  # values per q8_0 block: a row must be a multiple of it


def gguf_refusal(config) -> str | None:
    """Why llama.cpp cannot compute what the zoo config `config` computes (a clause), or None when the variant's
    GGUF architecture can."""
    variant = get_variant(config.model_type)
    architecture = variant.attention_class.gguf_architecture
    if architecture is None:
        return variant.attention_class.gguf_absence
    if architecture == "mamba":
        return mamba_gguf_refusal(config)
    if variant.attention_class.mask_refusal(config) is not None:
        return f"{variant.attention_class.mask_refusal(config)}, which llama.cpp's {architecture} mask does not keep"
    for field, required in LLAMA_BACKBONE.items():
        if getattr(config, field) != required:
            return f"{field}={getattr(config, field)!r}: llama.cpp's {architecture} needs {required!r}"
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r}: llama.cpp's {architecture} gates its MLP with SiLU"
    if config.rope_parameters.get("rope_type", "default") != "default":
        return f"rope_type={config.rope_parameters['rope_type']!r}: only unscaled RoPE is written"
    if architecture == "deepseek2":
        if config.attention_bias or config.mlp_bias:
            return "attention_bias / mlp_bias: llama.cpp's deepseek2 has no biases"
        if not config.latent_norm or config.rope_frequencies is not None:
            return (
                "latent_norm=False / rope_frequencies (a converted MLA): llama.cpp's deepseek2 normalises the latent "
                "and has no bias to hold the constant channel that cancels the norm in the DeepSeek-V3 export"
            )
        if config.qk_nope_head_dim < 1:
            return "qk_nope_head_dim=0: llama.cpp's deepseek2 needs a RoPE-free part in every query head"
    return None


def mamba_gguf_refusal(config) -> str | None:
    """Why llama.cpp's `mamba` cannot compute what the zoo `mamba` config `config` computes, or None."""
    reason = mamba_refusal(config)  # llama.cpp's mamba is transformers' MambaForCausalLM's block, less two choices
    if reason is not None:
        return reason.replace("mamba equivalent", "equivalent in llama.cpp's mamba")
    if config.use_bias:
        return "use_bias=True: llama.cpp's mamba has no bias on in_proj and out_proj (ssm_in, ssm_out)"
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r}: llama.cpp's mamba applies SiLU after the convolution"
    if config.intermediate_size != 2 * config.hidden_size:
        return (
            f"intermediate_size={config.intermediate_size}: llama.cpp's mamba loads only the paper's expansion of 2 "
            f"(intermediate_size = 2 * hidden_size = {2 * config.hidden_size})"
        )
    return None


def tokenizer_refusal(tokenizer_json: dict) -> str | None:
    """Why llama.cpp's `gpt2` tokenizer would split text differently from this tokenizer (`tokenizer.json` as a
    dict), or None when it splits the same."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')!r}, and only byte-level BPE is written"
    if tokenizer_json.get("normalizer") is not None:
        return "it normalises text first, which llama.cpp's gpt2 tokenizer does not"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space"):
        return f"its pre-tokenizer ({pre.get('type')!r}) is not GPT-2's byte level without a prefix space"
    # without merges every byte is its own token, however the text is split; with merges the split must be GPT-2's
    if model.get("merges") and not pre.get("use_regex", True):
        return "it merges across GPT-2's word boundaries (ByteLevel without its regular expression)"
    return None


def permute_rotary(weight: torch.Tensor, heads: int, unrotated: int = 0) -> torch.Tensor:
    """Rows of a query or key projection (or bias) reordered per head from rotate_half pairs (i, i + d/2) to
    llama.cpp's adjacent pairs (2i, 2i + 1); the first `unrotated` rows of each head (MLA's RoPE-free part) stay."""
    per_head = weight.reshape(heads, weight.shape[0] // heads, *weight.shape[1:])  # (heads, u + d, ...)
    plain, rotated = per_head[:, :unrotated], per_head[:, unrotated:]
    half = rotated.shape[1] // 2
    # (heads, d, ...) -> (heads, 2, d/2, ...) -> (heads, d/2, 2, ...) -> (heads, d, ...)
    rotated = rotated.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(rotated.shape)
    return torch.cat((plain, rotated), dim=1).reshape(weight.shape)


def tokenizer_json_of(tokenizer) -> dict:
    """The `tokenizer.json` of a fast tokenizer, as a dict."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer; GGUF needs its merges")
    return json.loads(backend.to_str())


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Tokens, types, merges and special ids of a byte-level BPE tokenizer, as llama.cpp's `gpt2` model reads them."""
    import gguf

    data = tokenizer_json_of(tokenizer)
    reason = tokenizer_refusal(data)
    if reason is not None:
        raise ValueError(f"the tokenizer cannot be written to GGUF: {reason}.")
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(by_id)}, past the model's vocab_size={vocab_size}.")
    special = set(tokenizer.all_special_ids) | {
        added["id"] for added in data.get("added_tokens", []) if added.get("special")
    }
    tokens, types = [], []
    for index in range(vocab_size):  # an embedding row without a token is padding that llama.cpp never emits
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in data["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    # the zoo's tokenizer adds no BOS (nor EOS) to what it encodes; llama.cpp must not either
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def stored(tensor: torch.Tensor, dtype: str, float32: bool = False):
    """(array, raw type or None) of one tensor at `dtype`: vectors (and any tensor with `float32`) stay float32,
    matrices take `dtype`."""
    import gguf

    array = tensor.detach().to(torch.float32).contiguous().numpy()
    if array.ndim == 1 or dtype == "f32" or float32:
        return array, None
    if dtype == "q8_0" and array.shape[-1] % Q8_0_BLOCK == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def add_attention_metadata(writer, config) -> None:
    """What llama.cpp's attention architectures (`llama`, `granite_swa`, `deepseek2`) share."""
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))


def add_llama_metadata(writer, config) -> None:
    add_attention_metadata(writer, config)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)


def add_granite_swa_metadata(writer, config) -> None:
    add_llama_metadata(writer, config)
    writer.add_logit_scale(1.0)  # granite divides the logits by it
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([True] * config.num_hidden_layers)  # every layer attends through the window
    writer.add_rope_freq_base_swa(float(config.rope_parameters["rope_theta"]))


NO_SINK = -1e30  # an attention sink's logit: exp(NO_SINK - max) is 0 in every softmax


def add_deepseek2_metadata(writer, config) -> None:
    add_attention_metadata(writer, config)
    # the non-absorbed MLA of llama.cpp: every head's keys and values up-projected, like MHA with H key/value heads
    writer.add_head_count_kv(config.num_attention_heads)
    writer.add_key_length(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length(config.v_head_dim)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_q_lora_rank(config.q_lora_rank or 0)  # 0: queries through attn_q directly
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_leading_dense_block_count(config.num_hidden_layers)  # no layer has experts
    writer.add_expert_feed_forward_length(config.intermediate_size)  # read even when no layer has experts
    writer.add_expert_shared_count(0)


def add_mamba_metadata(writer, config) -> None:
    # no attention and no MLP: llama.cpp reads the two counts all the same, and 0 is what its own converter writes
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_inner_size(config.intermediate_size)
    writer.add_ssm_state_size(config.state_size)
    writer.add_ssm_time_step_rank(config.time_step_rank)
    writer.add_ssm_dt_b_c_rms(False)  # Falcon-Mamba's norms of Δ, B and C: not Mamba-1's


METADATA = {
    "llama": add_llama_metadata,
    "granite_swa": add_granite_swa_metadata,
    "deepseek2": add_deepseek2_metadata,
    "mamba": add_mamba_metadata,
}


def layer_tensor_names(architecture: str) -> dict[str, tuple]:
    """A decoder layer's state-dict names (after `model.layers.N.`) -> (GGUF tensor kind, "weight", "bias" or "")."""
    import gguf

    kind = gguf.MODEL_TENSOR
    if architecture == "mamba":
        return {
            "input_layernorm.weight": (kind.ATTN_NORM, "weight"),
            "self_attn.in_proj.weight": (kind.SSM_IN, "weight"),
            "self_attn.conv1d.weight": (kind.SSM_CONV1D, "weight"),
            "self_attn.conv1d.bias": (kind.SSM_CONV1D, "bias"),
            "self_attn.x_proj.weight": (kind.SSM_X, "weight"),
            "self_attn.dt_proj.weight": (kind.SSM_DT, "weight"),
            "self_attn.dt_proj.bias": (kind.SSM_DT, "bias"),
            "self_attn.A_log": (kind.SSM_A, ""),  # llama.cpp names these two without a suffix
            "self_attn.D": (kind.SSM_D, ""),
            "self_attn.out_proj.weight": (kind.SSM_OUT, "weight"),
        }
    names = {
        "input_layernorm.weight": (kind.ATTN_NORM, "weight"),
        "post_attention_layernorm.weight": (kind.FFN_NORM, "weight"),
    }
    projections = {"mlp.gate_proj": kind.FFN_GATE, "mlp.up_proj": kind.FFN_UP, "mlp.down_proj": kind.FFN_DOWN}
    projections["self_attn.o_proj"] = kind.ATTN_OUT
    if architecture in ("llama", "granite_swa"):
        projections.update({"self_attn.q_proj": kind.ATTN_Q, "self_attn.k_proj": kind.ATTN_K})
        projections["self_attn.v_proj"] = kind.ATTN_V
    else:
        projections.update(
            {
                "self_attn.q_proj": kind.ATTN_Q,
                "self_attn.q_a_proj": kind.ATTN_Q_A,
                "self_attn.q_b_proj": kind.ATTN_Q_B,
                "self_attn.kv_a_proj_with_mqa": kind.ATTN_KV_A_MQA,
                "self_attn.kv_b_proj": kind.ATTN_KV_B,
            }
        )
        names["self_attn.q_a_layernorm.weight"] = (kind.ATTN_Q_A_NORM, "weight")
        names["self_attn.kv_a_layernorm.weight"] = (kind.ATTN_KV_A_NORM, "weight")
    for module, tensor_kind in projections.items():
        for part in ("weight", "bias"):
            names[f"{module}.{part}"] = (tensor_kind, part)
    return names


def mamba_tensor(rest: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a mamba layer's `rest`) as llama.cpp's mamba reads it."""
    if rest == "self_attn.A_log":
        return -torch.exp(tensor.float())  # (D, N): A itself, as the scan uses it
    if rest == "self_attn.conv1d.weight":
        return tensor.reshape(tensor.shape[0], tensor.shape[-1])  # (D, 1, k) -> (D, k): one filter per channel
    return tensor


def rotary_rows(config, architecture: str, rest: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a layer's `rest`) with the rows that RoPE rotates in llama.cpp's pair order."""
    if architecture == "mamba":
        return mamba_tensor(rest, tensor)
    if architecture in ("llama", "granite_swa"):
        if rest.startswith("self_attn.q_proj"):
            return permute_rotary(tensor, config.num_attention_heads)
        if rest.startswith("self_attn.k_proj"):
            return permute_rotary(tensor, config.num_key_value_heads)
        return tensor
    if rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
        return permute_rotary(tensor, config.num_attention_heads, config.qk_nope_head_dim)
    if rest == "self_attn.kv_a_proj_with_mqa.weight":  # the latent's rows, then the shared RoPE key's
        return permute_rotary(tensor, 1, config.kv_lora_rank)
    return tensor


def write_gguf(model, tokenizer, path: str | os.PathLike, dtype: str = "f16", name: str | None = None) -> Path:
    """Write a zoo causal LM and its tokenizer as one GGUF file for llama.cpp (`llama` for the MHA family,
    `granite_swa` for the sliding window, `deepseek2` for MLA, `mamba` for Mamba)."""
    import gguf

    config = model.config
    reason = gguf_refusal(config)
    if reason is not None:
        raise ValueError(f"{config.model_type} cannot be written to GGUF: {reason}.")
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {GGUF_DTYPES}.")
    architecture = get_variant(config.model_type).attention_class.gguf_architecture
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name or path.stem)
    writer.add_file_type(
        {
            "f32": gguf.LlamaFileType.ALL_F32,
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        }[dtype]
    )
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    METADATA[architecture](writer, config)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, tokenizer, config.vocab_size)

    names, layer_names = gguf.TENSOR_NAMES, layer_tensor_names(architecture)
    # llama.cpp's convolution and scan kernels read these in float32 (its converter never stores them otherwise)
    float32_kinds = (gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.SSM_A)
    for key, tensor in model.state_dict().items():
        kind = None
        if key == "model.embed_tokens.weight":
            target = f"{names[gguf.MODEL_TENSOR.TOKEN_EMBD]}.weight"
        elif key == "model.norm.weight":
            target = f"{names[gguf.MODEL_TENSOR.OUTPUT_NORM]}.weight"
        elif key == "lm_head.weight":
            if config.tie_word_embeddings:
                continue  # llama.cpp reads the embedding when the file has no output matrix
            target = f"{names[gguf.MODEL_TENSOR.OUTPUT]}.weight"
        else:
            _, _, layer, rest = key.split(".", 3)  # model.layers.N.<rest>
            if rest not in layer_names:
                raise ValueError(f"{key}: no GGUF tensor for it in llama.cpp's {architecture} architecture")
            kind, part = layer_names[rest]
            target = names[kind].format(bid=int(layer)) + (f".{part}" if part else "")
            tensor = rotary_rows(config, architecture, rest, tensor)
        array, raw_dtype = stored(tensor, dtype, float32=kind in float32_kinds)
        if raw_dtype is None:
            writer.add_tensor(target, array)
        else:
            writer.add_tensor(target, array, raw_dtype=raw_dtype)  # the logical shape follows from the bytes

    if architecture == "granite_swa":
        sinks = np.full((config.num_attention_heads,), NO_SINK, dtype=np.float32)
        for layer in range(config.num_hidden_layers):
            writer.add_tensor(f"{names[gguf.MODEL_TENSOR.ATTN_SINKS].format(bid=layer)}.weight", sinks)
    if architecture == "mamba" and not config.use_conv_bias:
        zeros = np.zeros((config.intermediate_size,), dtype=np.float32)  # llama.cpp's mamba always adds one
        for layer in range(config.num_hidden_layers):
            writer.add_tensor(f"{names[gguf.MODEL_TENSOR.SSM_CONV1D].format(bid=layer)}.bias", zeros)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["GGUF_DTYPES", "gguf_refusal", "permute_rotary", "tokenizer_refusal", "write_gguf"]
