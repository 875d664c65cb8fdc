"""Zoo checkpoints as GGUF files that llama.cpp (and ollama, llama-cpp-python) run, written with the `gguf` package.

llama.cpp has an architecture for the MHA family only: `llama`, with grouped key/value heads through
`head_count_kv`. Its tensor names and metadata keys come from the `gguf` package's constants (`MODEL_TENSOR`,
`GGUFWriter.add_*`), and two of llama.cpp's conventions matter for the numbers:

- RoPE: llama.cpp's `llama` rotates adjacent channel pairs (2i, 2i + 1), transformers' Llama pairs i with i + d/2.
  The rows of `q_proj` and `k_proj` (and their biases) are reordered per head so that llama.cpp's pairs are
  transformers' pairs: row 2i + j of a head is row j·d/2 + i of the original.
- Types: f32 keeps every tensor in float32; f16 stores matrices in float16 and keeps the norms' vectors in float32,
  as llama.cpp's own converter does; q8_0 quantises matrices whose rows are a multiple of its 32-value block and
  stores the others in float16.

The tokenizer goes into the file too, so llama.cpp tokenizes as the checkpoint's tokenizer does: the zoo's byte-level
BPE is GPT-2's scheme (`tokenizer.ggml.model = "gpt2"`, pre-tokenizer `gpt-2`, the same regular expression), with its
tokens, merges, token types (special tokens are control tokens) and BOS / EOS / padding ids. A tokenizer llama.cpp
would split differently (another model, a normaliser, no GPT-2 regular expression with merges) is refused.

What else is refused, naming the field: a position type other than RoPE, a norm other than RMSNorm, an MLP other
than the gated one, an activation other than SiLU, RoPE scaling, and any variant outside the MHA family (reasons in
`gguf_refusal`).
"""

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..models import get_variant
from .llama import LLAMA_BACKBONE

GGUF_DTYPES = ("f32", "f16", "q8_0")
GGUF_ARCHITECTURE = "llama"
Q8_0_BLOCK = 32  # values per q8_0 block: a row must be a multiple of it


def gguf_refusal(config) -> str | None:
    """Why llama.cpp's `llama` architecture cannot compute what the zoo config `config` computes (a clause), or
    None when it can."""
    variant = get_variant(config.model_type)
    architecture = variant.attention_class.gguf_architecture
    if architecture is None:
        if variant.family == "sliding_window":
            return (
                "llama.cpp's llama architecture ignores sliding_window and attends over the whole context (measured: "
                "its tokens leave the zoo's once the prompt is longer than the window), and no llama.cpp "
                "architecture with a window shares Llama's layout"
            )
        return f"llama.cpp has no architecture for its attention ({variant.description})"
    for field, required in LLAMA_BACKBONE.items():
        if getattr(config, field) != required:
            return f"{field}={getattr(config, field)!r}: llama.cpp's {architecture} needs {required!r}"
    if config.hidden_act != "silu":
        return f"hidden_act={config.hidden_act!r}: llama.cpp's {architecture} gates its MLP with SiLU"
    if config.rope_parameters.get("rope_type", "default") != "default":
        return f"rope_type={config.rope_parameters['rope_type']!r}: only unscaled RoPE is written"
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


def permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection (or bias) reordered per head from rotate_half pairs (i, i + d/2) to
    llama.cpp's adjacent pairs (2i, 2i + 1)."""
    head_dim = weight.shape[0] // heads
    # (heads * d, ...) -> (heads, 2, d/2, ...) -> (heads, d/2, 2, ...) -> (heads * d, ...)
    split = weight.reshape(heads, 2, head_dim // 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


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


def stored(tensor: torch.Tensor, dtype: str):
    """(array, raw type or None) of one tensor at `dtype`: vectors stay float32, matrices take `dtype`."""
    import gguf

    array = tensor.detach().to(torch.float32).contiguous().numpy()
    if array.ndim == 1 or dtype == "f32":
        return array, None
    if dtype == "q8_0" and array.shape[-1] % Q8_0_BLOCK == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def write_gguf(model, tokenizer, path: str | os.PathLike, dtype: str = "f16", name: str | None = None) -> Path:
    """Write a zoo MHA-family causal LM and its tokenizer as one GGUF file for llama.cpp's `llama` architecture."""
    import gguf

    config = model.config
    reason = gguf_refusal(config)
    if reason is not None:
        raise ValueError(f"{config.model_type} cannot be written to GGUF: {reason}.")
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {GGUF_DTYPES}.")
    path = Path(path)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHITECTURE)
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
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, tokenizer, config.vocab_size)

    names = gguf.TENSOR_NAMES
    layer_names = {
        "input_layernorm.weight": (gguf.MODEL_TENSOR.ATTN_NORM, "weight"),
        "post_attention_layernorm.weight": (gguf.MODEL_TENSOR.FFN_NORM, "weight"),
        "mlp.gate_proj.weight": (gguf.MODEL_TENSOR.FFN_GATE, "weight"),
        "mlp.up_proj.weight": (gguf.MODEL_TENSOR.FFN_UP, "weight"),
        "mlp.down_proj.weight": (gguf.MODEL_TENSOR.FFN_DOWN, "weight"),
    }
    for projection, kind in (("q", gguf.MODEL_TENSOR.ATTN_Q), ("k", gguf.MODEL_TENSOR.ATTN_K)):
        for part in ("weight", "bias"):
            layer_names[f"self_attn.{projection}_proj.{part}"] = (kind, part)
    for part in ("weight", "bias"):
        layer_names[f"self_attn.v_proj.{part}"] = (gguf.MODEL_TENSOR.ATTN_V, part)
        layer_names[f"self_attn.o_proj.{part}"] = (gguf.MODEL_TENSOR.ATTN_OUT, part)
        for mlp, kind in (("gate", gguf.MODEL_TENSOR.FFN_GATE), ("up", gguf.MODEL_TENSOR.FFN_UP)):
            layer_names[f"mlp.{mlp}_proj.{part}"] = (kind, part)
        layer_names[f"mlp.down_proj.{part}"] = (gguf.MODEL_TENSOR.FFN_DOWN, part)

    state = model.state_dict()
    for key, tensor in state.items():
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
                raise ValueError(f"{key}: no GGUF tensor for it in llama.cpp's {GGUF_ARCHITECTURE} architecture")
            kind, part = layer_names[rest]
            target = f"{names[kind].format(bid=int(layer))}.{part}"
            if rest.startswith("self_attn.q_proj"):
                tensor = permute_rotary(tensor, heads)
            elif rest.startswith("self_attn.k_proj"):
                tensor = permute_rotary(tensor, kv_heads)
        array, raw_dtype = stored(tensor, dtype)
        if raw_dtype is None:
            writer.add_tensor(target, array)
        else:
            writer.add_tensor(target, array, raw_dtype=raw_dtype)  # the logical shape follows from the bytes

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["GGUF_DTYPES", "gguf_refusal", "permute_rotary", "tokenizer_refusal", "write_gguf"]
