"""Mamba (Gu & Dao 2023): the chunked scan against the recurrence, packed documents, long prompts prefilled in pieces
then decoded, the constant decoding state, the parity anchor (transformers' `MambaForCausalLM` imported and exported
back: the same logits and greedy tokens), the optional MLP of the backbone, and the refusals."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MambaConfig, MambaForCausalLM

from hf_attn_zoo.convert.mamba import from_mamba, to_mamba
from hf_attn_zoo.errors import UserError
from hf_attn_zoo.export import export_checkpoint, import_checkpoint
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.mamba import closed_form_scan, selective_scan

from conftest import (
    ATOL,
    VOCAB_SIZE,
    assert_loads_without_the_package,
    left_padded_batch,
    positions_from_mask,
    returned_cache,
    tiny_config,
    tiny_model,
)


def scan_inputs(batch=2, width=6, states=5, length=23, seed=0):
    """x `(B, D, T)`, Δ `(B, D, T)` in the range softplus gives at init and beyond, A `(D, N)` < 0, B and C."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, length, generator=generator)
    delta = torch.rand(batch, width, length, generator=generator) * 0.5 + 1e-3
    A = -torch.arange(1, states + 1, dtype=torch.float32).expand(width, -1) * (
        1 + torch.rand(width, 1, generator=generator)
    )
    B = torch.randn(batch, length, states, generator=generator)
    C = torch.randn(batch, length, states, generator=generator)
    return x, delta, A, B, C


def recurrence(x, delta, A, B, C, state=None, documents=None):
    """Algorithm 2's scan one token at a time in float64: h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t, y_t = C_t h_t; the
    state restarts where `documents` changes."""
    x, delta, A, B, C = (t.double() for t in (x, delta, A, B, C))
    batch, width, length = x.shape
    h = torch.zeros(batch, width, A.shape[-1], dtype=torch.float64) if state is None else state.double()
    ys = []
    for t in range(length):
        if documents is not None and t > 0:
            h = h * (documents[:, t] == documents[:, t - 1]).double()[:, None, None]
        decay = torch.exp(delta[:, :, t, None] * A)  # (B, D, N)
        h = decay * h + delta[:, :, t, None] * B[:, None, t] * x[:, :, t, None]
        ys.append((h * C[:, None, t]).sum(-1))
    return torch.stack(ys, -1).float(), h.float()


@pytest.mark.parametrize("chunk", [1, 3, 4, 23, 64])
def test_chunked_scan_equals_the_recurrence(chunk):
    """Chunks of 1 (the recurrence itself), of sizes that do and do not divide T, and one longer than T."""
    x, delta, A, B, C = scan_inputs()
    y, state = selective_scan(x, delta, A, B, C, None, chunk)
    expected, expected_state = recurrence(x, delta, A, B, C)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=0)


def test_the_closed_form_for_export_equals_the_recurrence():
    """The loop-free form that exported graphs run: from zeros, from a carried state, and over packed documents."""
    x, delta, A, B, C = scan_inputs()
    expected, expected_state = recurrence(x, delta, A, B, C)
    zeros = x.new_zeros(x.shape[0], x.shape[1], A.shape[-1])
    y, state = closed_form_scan(x, delta, A, B, C, zeros)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=0)
    _, carried = closed_form_scan(x[..., :10], delta[..., :10], A, B[:, :10], C[:, :10], zeros)
    rest, final = closed_form_scan(x[..., 10:], delta[..., 10:], A, B[:, 10:], C[:, 10:], carried)
    torch.testing.assert_close(rest, expected[..., 10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=ATOL, rtol=0)
    documents = torch.tensor([[0] * 5 + [1] * 9 + [2] * 9, [0] * 12 + [1] * 11])
    y, _ = closed_form_scan(x, delta, A, B, C, zeros, documents)
    torch.testing.assert_close(y, recurrence(x, delta, A, B, C, documents=documents)[0], atol=ATOL, rtol=0)


def test_chunked_scan_continues_from_a_state():
    x, delta, A, B, C = scan_inputs()
    first, state = selective_scan(x[..., :10], delta[..., :10], A, B[:, :10], C[:, :10], None, 4)
    rest, final = selective_scan(x[..., 10:], delta[..., 10:], A, B[:, 10:], C[:, 10:], state, 4)
    expected, expected_state = recurrence(x, delta, A, B, C)
    torch.testing.assert_close(torch.cat((first, rest), -1), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_packed_documents_restart_the_state(chunk):
    x, delta, A, B, C = scan_inputs()
    documents = torch.tensor([[0] * 5 + [1] * 9 + [2] * 9, [0] * 12 + [1] * 11])
    y, _ = selective_scan(x, delta, A, B, C, None, chunk, documents)
    expected, _ = recurrence(x, delta, A, B, C, documents=documents)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)


def test_a_packed_row_gives_each_document_what_it_gets_alone():
    """Padding-free training: position_ids restarting at 0 split the row; the convolution reads its own document
    only and the state restarts, across chunk boundaries (chunks of 4) and inside them."""
    model = tiny_model("mamba")
    generator = torch.Generator().manual_seed(5)
    documents = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator) for n in (6, 2, 9)]
    row = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(len(d)) for d in documents])[None]
    with torch.no_grad():
        packed = model(row, position_ids=positions, use_cache=False).logits[0]
        start = 0
        for document in documents:
            alone = model(document[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(document)], alone, atol=ATOL, rtol=0)
            start += len(document)


def test_long_left_padded_prompts_prefilled_in_pieces_then_decoded_equal_the_uncached_forward():
    """Prompts of 41, 30 and 9 tokens (many chunks of 4), prefilled in pieces of 10, then 6 tokens one at a time."""
    model = tiny_model("mamba")
    input_ids, attention_mask, rows = left_padded_batch(lengths=(41, 30, 9), seed=2)
    positions = positions_from_mask(attention_mask)
    cache, pieces = None, []
    bounds = [0, 10, 20, 30, 35, *range(36, input_ids.shape[1] + 1)]
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            out = model(
                input_ids[:, start:end],
                attention_mask=attention_mask[:, :end],
                position_ids=positions[:, start:end],
                cache=cache,
                use_cache=True,
            )
            cache = returned_cache(out)
            pieces.append(out.logits)
        cached = torch.cat(pieces, 1)
        for i, row in enumerate(rows):
            alone = model(row[None], use_cache=False).logits[0]
            torch.testing.assert_close(cached[i, -len(row) :], alone, atol=ATOL, rtol=0)


def test_decoding_state_is_constant_in_the_length():
    """Per layer a convolution window of k - 1 inputs and D x N states, whatever the length."""
    model = tiny_model("mamba")
    config = model.config
    sizes = []
    for length in (5, 40):
        with torch.no_grad():
            cache = returned_cache(model(torch.randint(3, VOCAB_SIZE, (1, length)), use_cache=True))
        sizes.append(sum(layer.nbytes() for layer in cache.layers))
        held = cache.layers[0].read()
        assert held["conv"].shape == (1, config.intermediate_size, config.conv_kernel - 1)
        assert held["ssm"].shape == (1, config.intermediate_size, config.state_size)
    assert sizes[0] == sizes[1]


def test_assisted_decoding_is_refused_by_the_state():
    model = tiny_model("mamba")
    with torch.no_grad():
        cache = returned_cache(model(torch.randint(3, VOCAB_SIZE, (1, 6)), use_cache=True))
    with pytest.raises(ValueError, match="running state"):
        cache.crop(3)


# the parity anchor -------------------------------------------------------------------------------------------------
def native_mamba(seed: int = 0, **fields) -> MambaForCausalLM:
    """A tiny random transformers Mamba, built locally (nothing from the Hub); large init so greedy choices are far
    from ties."""
    torch.manual_seed(seed)
    config = dict(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, state_size=8, num_hidden_layers=2, pad_token_id=0
    )
    return MambaForCausalLM(MambaConfig(**{**config, "initializer_range": 0.2, **fields})).eval()


def assert_same_function(ours, theirs) -> None:
    """Logits within 1e-5 on a batch (a left-padded one too), and the same 12 greedy tokens."""
    ids = torch.randint(3, VOCAB_SIZE, (2, 37), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=ATOL, rtol=0)
        input_ids, attention_mask, rows = left_padded_batch()
        a = ours(input_ids, attention_mask=attention_mask).logits
        b = theirs(input_ids, attention_mask=attention_mask).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(a[i, -len(row) :], b[i, -len(row) :], atol=ATOL, rtol=0)
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompt = ids[:, :9]
    assert torch.equal(ours.generate(prompt, **settings), theirs.generate(prompt, **settings))


@pytest.mark.parametrize(
    "fields", [{}, {"use_bias": True, "use_conv_bias": False, "time_step_rank": 3, "tie_word_embeddings": False}]
)
def test_from_mamba_gives_transformers_logits_and_greedy_tokens(fields):
    native = native_mamba(**fields)
    zoo = from_mamba(native).eval()
    assert type(zoo) is VARIANTS["mamba"].causal_lm_class and zoo.config.mlp_type == "none"
    assert all(layer.mlp is None for layer in zoo.model.layers)
    assert_same_function(zoo, native)


def test_export_back_to_a_native_mamba_gives_the_same_tokens():
    zoo = tiny_model("mamba")
    native = to_mamba(zoo).eval()
    assert type(native) is MambaForCausalLM
    assert_same_function(zoo, native)


def test_import_and_export_commands_round_trip(tmp_path):
    """`hf-attn-zoo import` of a saved MambaForCausalLM folder, then `export --to native` back: transformers loads
    both, and all three compute the same function."""
    native = native_mamba()
    native.save_pretrained(tmp_path / "native")
    imported = import_checkpoint(tmp_path / "native", tmp_path / "zoo")
    zoo = AutoModelForCausalLM.from_pretrained(imported).eval()
    assert zoo.config.model_type == "zoo_mamba"
    assert_same_function(zoo, native)
    exported = export_checkpoint(imported, "native", tmp_path / "back")
    back = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(back) is MambaForCausalLM
    assert_same_function(zoo, back)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"use_bias": True}, "use_bias=True: llama.cpp's mamba has no bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu': llama.cpp's mamba applies SiLU"),
        ({"scale_embedding": True}, "scale_embedding=True"),
        ({"norm_position": "post"}, "norm_position='post' has no equivalent in llama.cpp's mamba"),
        ({"intermediate_size": 96}, "intermediate_size=96: llama.cpp's mamba loads only the paper's expansion of 2"),
    ],
)
def test_gguf_export_refuses_what_llama_cpps_mamba_cannot_compute(fields, named, tmp_path):
    pytest.importorskip("gguf", reason="the GGUF writer needs the `gguf` package (the [gguf] extra)")
    tiny_model("mamba", **fields).save_pretrained(tmp_path / "zoo")
    with pytest.raises(UserError, match=named) as refused:
        export_checkpoint(tmp_path / "zoo", "gguf", tmp_path / "gguf")
    assert "\n" not in str(refused.value) and not (tmp_path / "gguf").exists()


def test_gguf_without_a_convolution_bias_gets_zeros_and_keeps_the_scan_inputs_in_float32(tmp_path):
    """llama.cpp's mamba always adds a convolution bias: `use_conv_bias=False` is written as zeros, and transformers'
    GGUF loader (whose MambaConfig has the bias) computes the zoo's logits from the file. At f16 and q8_0 the
    convolution's weight and A stay float32, as llama.cpp's kernels read them."""
    gguf = pytest.importorskip("gguf", reason="the GGUF writer needs the `gguf` package (the [gguf] extra)")
    from hf_attn_zoo.convert.gguf_writer import write_gguf
    from hf_attn_zoo.data import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(["def f(x):\n    return x + 1\n" * 4], vocab_size=300)  # 256 bytes and merges
    zoo = tiny_model("mamba", use_conv_bias=False, vocab_size=len(tokenizer))
    path = write_gguf(zoo, tokenizer, tmp_path / "mamba.gguf", dtype="f32")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    assert type(loaded) is MambaForCausalLM
    assert all((layer.mixer.conv1d.bias == 0).all() for layer in loaded.backbone.layers)
    ids = torch.randint(3, len(tokenizer), (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, zoo(ids).logits, atol=ATOL, rtol=ATOL)
    for dtype in ("f16", "q8_0"):
        reader = gguf.GGUFReader(write_gguf(zoo, tokenizer, tmp_path / f"{dtype}.gguf", dtype=dtype))
        types = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
        assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == gguf.GGMLQuantizationType.F32
        assert types["blk.0.ssm_in.weight"] != gguf.GGMLQuantizationType.F32


def test_native_export_refuses_what_mamba_cannot_hold():
    zoo = tiny_model("mamba", scale_embedding=True)
    with pytest.raises(ValueError, match="scale_embedding"):
        to_mamba(zoo)


# the backbone's optional MLP and the refusals -----------------------------------------------------------------------
def test_the_mlp_is_optional_on_the_backbone_and_kept_by_default():
    """`mlp_type="none"` leaves the MLP and its norm out of every layer (any variant); the default keeps them."""
    default = tiny_model("gqa")
    assert all(layer.mlp is not None and layer.post_attention_layernorm is not None for layer in default.model.layers)
    bare = tiny_model("gqa", mlp_type="none")
    assert not any("mlp" in name or "post_attention_layernorm" in name for name, _ in bare.named_parameters())
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        assert torch.isfinite(bare(input_ids, attention_mask=attention_mask).logits).all()
    assert VARIANTS["gqa"].lora_targets_for(bare.config) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert VARIANTS["mamba"].lora_targets == ["in_proj", "x_proj", "dt_proj", "out_proj"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"is_encoder_decoder": True}, "is_encoder_decoder=True"),
        ({"is_decoder": False}, "is_decoder=False"),
    ],
)
def test_no_encoder_form_is_refused_up_front_naming_why(fields, named):
    with pytest.raises(ValueError, match=rf"no bidirectional form: Mamba-1's selective scan is causal.*{named}"):
        tiny_config("mamba", **fields)


def test_absolute_positions_are_refused():
    with pytest.raises(ValueError, match="position_embedding_type"):
        tiny_config("mamba", position_embedding_type="learned")


def test_bfloat16_model_keeps_its_scan_in_float32():
    model = tiny_model("mamba").to(torch.bfloat16)
    with torch.no_grad():
        cache = returned_cache(model(torch.randint(3, VOCAB_SIZE, (1, 9)), use_cache=True))
        logits = model(torch.randint(3, VOCAB_SIZE, (1, 1)), cache=cache, use_cache=True).logits
    assert cache.layers[0].read()["ssm"].dtype == torch.float32
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_remote_code_loads_an_imported_mamba_without_the_package(tmp_path):
    """A checkpoint imported from transformers' Mamba carries the zoo's code (mamba.py and its siblings) and loads by
    `trust_remote_code` where hf_attn_zoo cannot be imported, with the same logits."""
    imported = import_checkpoint_of(native_mamba(), tmp_path)
    assert (imported / "mamba.py").is_file()
    assert_loads_without_the_package(imported, tmp_path)


def import_checkpoint_of(native: MambaForCausalLM, tmp_path):
    native.save_pretrained(tmp_path / "native")
    return import_checkpoint(tmp_path / "native", tmp_path / "zoo")
