"""MHA / GQA / MQA -> MLA (`hf_attn_zoo.convert.to_mla`): exact where it must be, the latent fit it claims, the cache
it promises, checkpoints that load anywhere, and errors that name the field."""

import json

import pytest
import torch
from test_cli import one_line_error, saved_model

from hf_attn_zoo.convert import to_mla
from hf_attn_zoo.convert.latent import MLA_METHODS, input_covariances, latent_attention
from hf_attn_zoo_cli import main

from conftest import ATOL, VOCAB_SIZE, assert_loads_without_the_package, left_padded_batch, returned_cache, tiny_model


def with_identical_key_heads(model):
    """`model` with every key head of a layer a copy of its first: one shared RoPE key can then carry them all."""
    config = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            rows = layer.self_attn.k_proj.weight.view(config.num_key_value_heads, config.head_dim, -1)
            rows[:] = rows[:1].clone()
    return model


def logits_on_real_tokens(model, input_ids, attention_mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits[attention_mask.bool()]


@pytest.mark.parametrize("method", MLA_METHODS)
@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_identical_key_heads_convert_exactly_at_full_rank_with_every_frequency(name, method):
    parent = with_identical_key_heads(tiny_model(name))
    config = parent.config
    full_rank = 2 * config.num_key_value_heads * config.head_dim - config.head_dim
    converted = to_mla(parent, kv_lora_rank=full_rank, method=method)
    assert converted.config.model_type == "zoo_mla" and converted.config.qk_rope_head_dim == config.head_dim
    assert converted.config.rope_frequencies == [list(range(config.head_dim // 2))] * config.num_hidden_layers
    input_ids, attention_mask, _ = left_padded_batch()
    expected = logits_on_real_tokens(parent, input_ids, attention_mask)
    torch.testing.assert_close(
        logits_on_real_tokens(converted, input_ids, attention_mask), expected, rtol=0, atol=ATOL
    )
    # decoding from the converted cache (the absorbed path) gives the parent's greedy tokens
    prompt = input_ids[:1, -4:]
    kept = dict(max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(converted.generate(prompt, **kept), parent.generate(prompt, **kept), rtol=0, atol=0)


def test_distinct_key_heads_are_not_exact_and_more_rank_fits_better():
    """Distinct key heads cannot share one RoPE key: the conversion approximates, and a larger latent approximates
    better (the low-rank step keeps the leading directions)."""
    parent = tiny_model("gqa")
    input_ids, attention_mask, _ = left_padded_batch()
    expected = logits_on_real_tokens(parent, input_ids, attention_mask)
    errors = [
        (logits_on_real_tokens(to_mla(parent, kv_lora_rank=rank), input_ids, attention_mask) - expected).pow(2).mean()
        for rank in (2, 8, 24)
    ]
    assert errors[0] > errors[1] > errors[2] > 0


def test_rorope_first_component_carries_the_most_key_energy():
    """RoRoPE's mixing puts at least as much of the keys into the shared RoPE component as the heads' mean does
    (it is the principal axis), measured on the keys themselves."""
    parent = tiny_model("gqa")
    layer = parent.model.layers[0].self_attn
    weights = {f"{name}.weight": getattr(layer, name).weight for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    config = parent.config
    hidden = torch.randn(512, config.hidden_size, generator=torch.Generator().manual_seed(0)).double()
    covariance = hidden.T @ hidden / hidden.shape[0]
    energy = {}
    for method in MLA_METHODS:
        converted, _ = latent_attention(
            weights, covariance, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 8, 4, method
        )
        rope_key = converted["kv_a_proj_with_mqa.weight"][8:]  # (2 * 4, D): the shared RoPE key's rows
        energy[method] = torch.einsum("rd,de,re->", rope_key, covariance, rope_key).item()
    assert energy["rorope"] >= energy["mean"] * (1 - 1e-9)


def test_calibration_weighs_the_latent_fit():
    """With calibration, the latent minimises the reconstruction error of keys and values on the calibration
    inputs; the weight-only fit (Σ = I) is never better there."""
    parent = tiny_model("mha")
    batches = [torch.randint(3, VOCAB_SIZE, (1, 40), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    covariance = input_covariances(parent, batches)[0]
    layer = parent.model.layers[0].self_attn
    weights = {f"{name}.weight": getattr(layer, name).weight for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    config = parent.config
    args = (config.num_attention_heads, config.num_key_value_heads, config.head_dim, 6, 2, "mean")
    values = layer.v_proj.weight.double()  # (H d, D)
    error = {}
    for label, sigma in (("calibrated", covariance), ("weights only", torch.eye(config.hidden_size).double())):
        converted, _ = latent_attention(weights, sigma, *args)
        down = converted["kv_a_proj_with_mqa.weight"][:6]  # (r, D)
        up = converted["kv_b_proj.weight"].view(config.num_attention_heads, 6 + config.head_dim, 6)[:, 6:]  # (H, d, r)
        residual = values - torch.einsum("hvr,rd->hvd", up, down).reshape(values.shape)  # values: one group per head
        error[label] = torch.einsum("vd,de,ve->", residual, covariance, residual).item()
    assert error["calibrated"] <= error["weights only"] * (1 + 1e-9)


def test_the_converted_cache_holds_the_latent_and_the_rope_key():
    parent = tiny_model("gqa")  # 2 key/value heads of width 8: 32 values per token per layer
    converted = to_mla(parent, kv_lora_rank=4, qk_rope_head_dim=4)
    input_ids = torch.randint(3, VOCAB_SIZE, (1, 20))
    with torch.no_grad():
        cache = returned_cache(converted(input_ids, use_cache=True))
        parent_cache = returned_cache(parent(input_ids, use_cache=True))
    per_token = [(layer.keys.numel() + layer.values.numel()) / input_ids.shape[1] for layer in cache.layers]
    parent_per_token = [
        (layer.keys.numel() + layer.values.numel()) / input_ids.shape[1] for layer in parent_cache.layers
    ]
    assert per_token == [4 + 4] * 2 and parent_per_token == [32] * 2


def test_the_cli_converts_a_checkpoint_that_loads_without_the_package(tmp_path, capsys):
    parent = saved_model(tmp_path / "parent")  # gqa: 4 heads of width 8 reading 2 key/value heads, a tokenizer
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    base = ["convert", str(parent), str(tmp_path / "mla"), "--to", "mla"]
    assert "--kv_lora_rank R" in one_line_error(capsys, base)
    assert "kv_lora_rank=99" in one_line_error(capsys, [*base, "--kv_lora_rank", "99"])
    assert "--method aligned does not apply" in one_line_error(
        capsys, [*base, "--kv_lora_rank", "8", "--method", "aligned"]
    )
    assert not (tmp_path / "mla").exists()
    options = ["--kv_lora_rank", "8", "--qk_rope_head_dim", "4", "--calibration", str(calibration)]
    assert main([*base, *options]) == 0
    assert "a latent of 8 and a shared RoPE key of 4 (rorope" in (tmp_path / "mla" / "README.md").read_text()
    assert_loads_without_the_package(tmp_path / "mla", tmp_path)


@pytest.mark.parametrize(
    ("name", "kwargs", "named"),
    [
        ("gqa", dict(kv_lora_rank=0), "kv_lora_rank"),
        ("gqa", dict(kv_lora_rank=25), "kv_lora_rank"),  # 2 x 2 x 8 - 8 = 24 rows at most
        ("gqa", dict(kv_lora_rank=4, qk_rope_head_dim=3), "qk_rope_head_dim"),
        ("gqa", dict(kv_lora_rank=4, qk_rope_head_dim=10), "qk_rope_head_dim"),
        ("gqa", dict(kv_lora_rank=4, method="svd"), "method"),
        ("aft_simple", dict(kv_lora_rank=4), "MHA family"),
    ],
)
def test_bad_conversions_name_the_field(name, kwargs, named):
    with pytest.raises(ValueError, match=named):
        to_mla(tiny_model(name), **kwargs)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_parents_the_conversion_cannot_read_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        to_mla(tiny_model("gqa", **fields), kv_lora_rank=4)


def test_the_smollm2_benchmark_runs_on_a_small_llama_and_resumes(tmp_path, monkeypatch):
    """`mla-smollm2` end to end with a small Llama standing in for SmolLM2's GGUF: every shape converted by
    every method and scored, the better one uptrained, the MQA runs beside, caches measured; a rerun trains nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from experiments.mla import latent
    from hf_attn_zoo.data import byte_level_tokenizer, tokenizer_fields

    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        **tokenizer_fields(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    monkeypatch.setattr(latent, "smollm2_gguf", lambda: tmp_path / "llama")
    monkeypatch.setattr(latent, "plain_checkpoint", lambda path: path)
    addresses = tmp_path / "sotu"
    addresses.mkdir()
    words = torch.randint(0, 26, (5, 1500, 5), generator=torch.Generator().manual_seed(0))  # varied text: many tokens
    for index, year in enumerate((1990, 1995, 2000, 2005, 2015)):
        text = " ".join("".join(chr(97 + int(c)) for c in word) for word in words[index])
        (addresses / f"{year}_someone_party.txt").write_text(f"Address of {year}. {text}")
    mqa_runs = tmp_path / "mqa"
    mqa_runs.mkdir()
    scores = {"converted": 500.0, "uptrained": 50.0}
    (mqa_runs / "aligned.json").write_text(
        json.dumps({"held_out_perplexity": scores, "reference_perplexity": scores, "conversion_seconds": 1.0})
    )
    setup = latent.LatentSetup(
        data_dir=str(addresses),
        output_dir=str(tmp_path / "out"),
        shapes=["8+8", "4+4"],
        steps=2,
        eval_every=1,
        held_out_chars=6000,
        calibration_addresses=2,
        calibration_tokens=256,
        mqa_runs=str(mqa_runs),
    )
    result = latent.run_latent(setup, log=lambda line: None)
    assert [(c["method"], c["kv_lora_rank"]) for c in result["conversions"]] == [
        ("rorope", 8),
        ("mean", 8),
        ("rorope", 4),
        ("mean", 4),
    ]
    # float32 bytes over 2 layers: GQA 2 x 2 heads x 8, MLA latent + RoPE key
    assert result["gqa"]["cache_bytes_per_token"] == 2 * 4 * 32
    assert [c["cache_bytes_per_token"] for c in result["conversions"]] == [2 * 4 * 16] * 2 + [2 * 4 * 8] * 2
    assert result["mqa"]["aligned"]["cache_bytes_per_token"] == 2 * 4 * 16
    for shape, uptrained in zip((8, 4), result["uptrained"]):
        candidates = [c for c in result["conversions"] if c["kv_lora_rank"] == shape]
        assert uptrained["method"] == min(candidates, key=lambda c: c["held_out_perplexity"])["method"]
        assert [r["step"] for r in uptrained["recovery"]] == [0, 1, 2]
        assert uptrained["held_out_perplexity"]["converted"] == pytest.approx(
            min(c["held_out_perplexity"] for c in candidates)
        )
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| MLA 4+4, " in table and "| MQA, aligned-pooled, uptrained |" in table
    monkeypatch.setattr(latent, "uptrain_converted", lambda *a, **k: pytest.fail("a finished run ran again"))
    monkeypatch.setattr(latent, "to_mla", lambda *a, **k: pytest.fail("a finished conversion ran again"))
    assert latent.run_latent(setup, log=lambda line: None)["uptrained"] == result["uptrained"]
    # --no_uptrain starts none and still reports those finished
    setup.uptrain = False
    assert latent.run_latent(setup, log=lambda line: None)["uptrained"] == result["uptrained"]


def test_the_decode_benchmark_compares_equal_parameter_models(tmp_path, monkeypatch):
    from experiments.mla import latent

    # SmolLM2's shape cut to 2 layers and a small vocabulary: the same attention, seconds to build
    monkeypatch.setitem(latent.SMOLLM2_SHAPE, "num_hidden_layers", 2)
    monkeypatch.setitem(latent.SMOLLM2_SHAPE, "vocab_size", 512)
    setup = latent.LatentDecodeSetup(output_dir=str(tmp_path), context_lengths=[16], new_tokens=3, repeats=1)
    rows = latent.run_latent_decode(setup, log=lambda line: None)
    assert [(row["shape"], row["cache"]) for row in rows] == [
        ("small", "dynamic"),
        ("small", "static"),
        ("smollm2", "dynamic"),
        ("smollm2", "static"),
    ]
    for row in rows:
        counts = row["parameters"]
        assert counts["absorbed"] == counts["expanded"] and abs(counts["gqa"] / counts["absorbed"] - 1) < 0.01
        assert row["decode_ratio"] > 0 and row["absorbed_over_expanded"] > 0
    small, _, smollm2, _ = rows
    # 6 layers x (latent 4 x 32 + RoPE key 16) float32 values; GQA: 6 x 2 heads x 2 x 32
    assert small["cache_bytes_per_token"] == {"absorbed": 6 * 144 * 4, "gqa": 6 * 128 * 4}
    # 2 layers x (latent 64 + RoPE key 32); GQA-3: 2 x 3 heads x 2 x 64
    assert smollm2["cache_bytes_per_token"] == {"absorbed": 2 * 96 * 4, "gqa": 2 * 384 * 4}
    # a static cache holds every position from the start: the same bytes per position
    assert rows[1]["cache_bytes_per_token"] == small["cache_bytes_per_token"]
    assert "| smollm2 | static | 16 |" in (tmp_path / "mla_decode.md").read_text()


def test_the_decode_clock_counts_steps_after_the_prefill():
    from experiments.mla import latent

    clock = latent.StepClock()
    model = tiny_model("mla").eval()
    model.generate(
        torch.tensor([[3, 4, 5]]),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        logits_processor=latent.LogitsProcessorList([clock]),
    )
    assert len(clock.stamps) == 4 and clock.stamps == sorted(clock.stamps)  # the prefill's token, then 3 steps
