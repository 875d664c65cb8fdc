"""The conformance suite (DESIGN §5): every registered variant with every position type it supports, CPU, fp32."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_attn_zoo.models import POSITION_EMBEDDING_TYPES, VARIANTS

import references
from conftest import (
    ATOL,
    CASES,
    CONFORMANCE,
    SDPA_CASES,
    VOCAB_SIZE,
    left_padded_batch,
    positions_from_mask,
    returned_cache,
    tiny_config,
    tiny_model,
)


def test_every_variant_is_covered():
    """A registered variant without a conformance entry would silently skip the whole suite."""
    assert set(VARIANTS) <= set(CONFORMANCE), f"add {sorted(set(VARIANTS) - set(CONFORMANCE))} to CONFORMANCE"
    for name, variant in VARIANTS.items():
        assert variant.position_types, f"{name} supports no position type"
        assert set(variant.position_types) <= set(POSITION_EMBEDDING_TYPES)


# 1. forward / backward -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_forward_backward(name, position):
    model = tiny_model(name, position).train()
    input_ids, attention_mask, _ = left_padded_batch()
    assert model(input_ids, attention_mask=attention_mask).logits.shape == (*input_ids.shape, VOCAB_SIZE)
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids.masked_fill(attention_mask == 0, -100))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{param_name} received no gradient"
        assert torch.isfinite(param.grad).all(), f"{param_name} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{param_name} received an all-zero gradient"


# 2. causality ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_causality(name, position):
    model = tiny_model(name, position)
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 16))
    changed = input_ids.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % VOCAB_SIZE
    with torch.no_grad():
        before, after = model(input_ids).logits, model(changed).logits
    assert torch.equal(before[:, :t], after[:, :t]), "a later token changed an earlier logit"
    assert not torch.allclose(before[:, t:], after[:, t:])


# 3. cached decoding ----------------------------------------------------------------------------------------------
def reference_logits(model, rows):
    """Each row alone, without cache or padding."""
    with torch.no_grad():
        return [model(row[None], use_cache=False).logits[0] for row in rows]


@pytest.mark.parametrize("name, position", CASES)
def test_chunked_prefill_then_decode_matches_uncached(name, position):
    model = tiny_model(name, position)
    input_ids, attention_mask, rows = left_padded_batch(lengths=(13, 9, 6))
    position_ids = positions_from_mask(attention_mask)
    expected = reference_logits(model, rows)

    cache, pieces = None, []
    # prefill in two chunks of 4 and 3 tokens, then one token at a time
    bounds = [0, 4, 7] + list(range(8, input_ids.shape[1] + 1))
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            out = model(
                input_ids[:, start:end],
                attention_mask=attention_mask[:, :end],
                position_ids=position_ids[:, start:end],
                cache=cache,
                use_cache=True,
            )
            cache = returned_cache(out)
            pieces.append(out.logits)
    cached = torch.cat(pieces, dim=1)
    for i, row in enumerate(rows):
        torch.testing.assert_close(cached[i, -len(row) :], expected[i], atol=ATOL, rtol=0)


def argmax_loop(model, input_ids, attention_mask, steps):
    """Greedy decoding by re-running the whole (padded) sequence without a cache at every step."""
    for _ in range(steps):
        with torch.no_grad():
            logits = model(
                input_ids,
                attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask),
                use_cache=False,
            ).logits
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=1)
    return input_ids


GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("name, position", CASES)
def test_greedy_generate_matches_argmax_loop(name, position):
    model = tiny_model(name, position)
    input_ids, attention_mask, _ = left_padded_batch()
    generated = model.generate(input_ids, attention_mask=attention_mask, generation_config=GREEDY)
    assert torch.equal(generated, argmax_loop(model, input_ids, attention_mask, GREEDY.max_new_tokens))


# 4. beam search --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_beam_search_with_cache_matches_without(name, position):
    model = tiny_model(name, position)
    input_ids, attention_mask, _ = left_padded_batch()
    beams = GenerationConfig(max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    with_cache = model.generate(input_ids, attention_mask=attention_mask, generation_config=beams, use_cache=True)
    without = model.generate(input_ids, attention_mask=attention_mask, generation_config=beams, use_cache=False)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("name, position", CASES)
def test_sampling_top_k_top_p(name, position):
    model = tiny_model(name, position)
    input_ids, attention_mask, _ = left_padded_batch()
    sample = dict(do_sample=True, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(3)
    first = model.generate(input_ids, attention_mask=attention_mask, top_k=5, top_p=0.9, **sample)
    torch.manual_seed(3)
    second = model.generate(input_ids, attention_mask=attention_mask, top_k=5, top_p=0.9, **sample)
    assert torch.equal(first, second), "sampling with the same seed must repeat"
    # top_k=1 leaves a single candidate: sampling is greedy decoding
    greedy = model.generate(input_ids, attention_mask=attention_mask, generation_config=GREEDY)
    top1 = model.generate(input_ids, attention_mask=attention_mask, top_k=1, **{**sample, "max_new_tokens": 8})
    assert torch.equal(top1, greedy)


# 5. left padding -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_left_padded_rows_match_rows_alone(name, position):
    model = tiny_model(name, position)
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        batched = model(input_ids, attention_mask=attention_mask).logits  # positions derived from the mask
    for i, (row, alone) in enumerate(zip(rows, reference_logits(model, rows))):
        torch.testing.assert_close(batched[i, -len(row) :], alone, atol=ATOL, rtol=0)


# 6. save / reload ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_save_reload_identical(name, position, tmp_path):
    model = tiny_model(name, position)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reloaded(input_ids).logits)
        assert torch.equal(
            model(input_ids, attention_mask=attention_mask).logits,
            reloaded(input_ids, attention_mask=attention_mask).logits,
        )


@pytest.mark.parametrize("name", [name for name in VARIANTS if name in CONFORMANCE])
def test_checkpoint_of_wrong_shape_fails_clearly(name, tmp_path):
    tiny_model(name).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.vocab_size = VOCAB_SIZE + 3
    with pytest.raises(ValueError, match=r"(?s)embed_tokens.*sized by vocab_size, hidden_size.*config.json"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=config)
    # as transformers does: a tensor the checkpoint lacks is reported and initialised, not an error
    config = AutoConfig.from_pretrained(tmp_path)
    config.num_hidden_layers = 3
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, config=config, output_loading_info=True)
    assert info["missing_keys"] and all(key.startswith("model.layers.2.") for key in info["missing_keys"])
    assert len(model.model.layers) == 3


# 7. invalid configs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [name for name in VARIANTS if name in CONFORMANCE])
def test_invalid_configs_raise_naming_the_field(name):
    variant = VARIANTS[name]
    unsupported = [p for p in POSITION_EMBEDDING_TYPES if p not in variant.position_types] + ["cosine"]
    cases = (
        CONFORMANCE[name]["invalid"]
        + [(dict(position_embedding_type=p), "position_embedding_type") for p in unsupported]
        + [
            (
                dict(hidden_size=30, num_attention_heads=4, num_key_value_heads=1 if name != "mha" else 4),
                "hidden_size",
            ),
            (dict(num_hidden_layers=0), "num_hidden_layers"),
            (dict(vocab_size=-5), "vocab_size"),
            (dict(norm_type="batchnorm"), "norm_type"),
            (dict(norm_position="middle"), "norm_position"),
            (dict(mlp_type="moe"), "mlp_type"),
            (dict(hidden_act="swish2"), "hidden_act"),
            (dict(attention_dropout=1.5), "attention_dropout"),
            (dict(hidden_dropout=-0.1), "hidden_dropout"),
        ]
    )
    for kwargs, field in cases:
        if name == "single_head" and "num_attention_heads" in kwargs and field != "num_attention_heads":
            continue
        with pytest.raises(ValueError, match=field):
            variant.config(**kwargs)


def test_config_mutated_after_construction_is_checked_by_the_model():
    config = tiny_config("gqa")
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads"):
        AutoModelForCausalLM.from_config(config)


# 8. backends and gradient checkpointing ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", SDPA_CASES)
def test_eager_and_sdpa_agree(name, position):
    config = tiny_config(name, position)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        a = eager(input_ids, attention_mask=attention_mask).logits
        b = sdpa(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(a[i, -len(row) :], b[i, -len(row) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name, position", CASES)
def test_gradient_checkpointing_same_loss_and_gradients(name, position):
    input_ids, attention_mask, _ = left_padded_batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    results = []
    for checkpointing in (False, True):
        model = tiny_model(name, position).train()
        if checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable()  # non-reentrant torch.utils.checkpoint
            else:  # transformers < 5.3 names it gradient_checkpointing_enable
                model.gradient_checkpointing_enable({"use_reentrant": False})
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    # the recomputed forward is the same code on the same inputs: the loss is bit-identical; a tied weight's two
    # gradient contributions may be summed in another order, so the gradients are compared at ATOL
    torch.testing.assert_close(loss_a, loss_b, atol=0, rtol=0)
    for param_name in grads_a:
        torch.testing.assert_close(grads_a[param_name], grads_b[param_name], atol=ATOL, rtol=0)


# 9. exactness against the naive reference -------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_matches_naive_reference(name, position):
    model = tiny_model(name, position)
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask, CONFORMANCE[name]["reference"])
        actual = model(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gqa", "mla", "mamba"])
def test_post_norm_matches_the_reference_and_decodes_as_it_reads(name):
    """`norm_position="post"`: every branch `norm(x + f(x))` (Vaswani et al. 2017), against the naive reference, and
    decoding from the cache token by token equals the uncached forward."""
    model = tiny_model(name, norm_position="post")
    pre = tiny_model(name)
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask, CONFORMANCE[name]["reference"])
        actual = model(input_ids, attention_mask=attention_mask).logits
        assert (actual - pre(input_ids, attention_mask=attention_mask).logits).abs().max() > 1e-2  # not ignored
        cache, pieces = None, []
        for t in range(input_ids.shape[1]):
            out = model(
                input_ids[:, t : t + 1],
                attention_mask=attention_mask[:, : t + 1],
                position_ids=positions_from_mask(attention_mask)[:, t : t + 1],
                cache=cache,
                use_cache=True,
            )
            cache = returned_cache(out)
            pieces.append(out.logits)
    decoded = torch.cat(pieces, dim=1)
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)
        torch.testing.assert_close(decoded[i, -len(row) :], actual[i, -len(row) :], atol=ATOL, rtol=0)


def test_differential_without_its_head_norm_matches_the_reference():
    """The paper's ablation: no per-head RMSNorm and no 1 - λ_init scale, and no norm weights to load."""
    model = tiny_model("differential", differential_head_norm=False)
    assert not any("head_norm" in name for name, _ in model.named_parameters())
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        expected = references.causal_lm_logits(model, input_ids, attention_mask, references.differential_attention)
        actual = model(input_ids, attention_mask=attention_mask).logits
        normed = tiny_model("differential")(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(actual[i, -len(row) :], expected[i, -len(row) :], atol=ATOL, rtol=0)
    assert (actual - normed).abs().max() > 1e-2  # the norm was left out, not ignored


@pytest.mark.parametrize("hidden_size", [64, 128, 4096])
def test_differential_head_norm_starts_at_a_values_rms(hidden_size):
    """Each head's normalised output starts at `(1 - λ_init)·min(1, σ·sqrt(d))`, the scale of a value at init (σ =
    initializer_range): the paper's 1 at its widths, 0.23 at 128, where a scale of 1 drowned the token embeddings."""
    from hf_attn_zoo.models.differential import head_norm_init

    config = VARIANTS["differential"].config(
        hidden_size=hidden_size, num_attention_heads=hidden_size // 32, num_hidden_layers=2, vocab_size=96
    )
    expected = min(1.0, config.initializer_range * hidden_size**0.5)
    assert head_norm_init(config) == pytest.approx(expected, rel=1e-12)
    if hidden_size > 128:
        return  # the formula alone: a 4,096-wide model is not built for it
    model = VARIANTS["differential"].causal_lm_class(config).eval()
    inputs = []
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
        assert torch.equal(layer.self_attn.head_norm.weight, torch.full((config.head_dim,), expected))
    with torch.no_grad():
        model(torch.randint(3, 96, (2, 16)))
    for layer, head_outputs in zip(model.model.layers, inputs, strict=True):
        # (B, T, H·d_h) -> (B, T, H, d_h): RMS per head, the RMSNorm's eps aside
        per_head = head_outputs.view(2, 16, config.num_attention_heads, -1).pow(2).mean(-1).sqrt()
        scale = (1 - layer.self_attn.lambda_init) * expected
        torch.testing.assert_close(per_head, torch.full_like(per_head, scale), atol=1e-3 * scale, rtol=0)


# outputs ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_optional_outputs_and_tuples(name, position):
    config = tiny_config(name, position)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
        plain = model(input_ids, attention_mask=attention_mask)
        as_tuple = model(input_ids, attention_mask=attention_mask, return_dict=False)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert torch.equal(as_tuple[0], plain.logits)
    # asking for the weights may route through a dense kernel (sliding window): same numbers within fp32 precision
    for i, row in enumerate(rows):
        torch.testing.assert_close(out.logits[i, -len(row) :], plain.logits[i, -len(row) :], atol=ATOL, rtol=0)
    attention = VARIANTS[name].attention_class  # what the variant declares about its weights
    if attention.attention_weights_absence(config):
        assert out.attentions is None or all(a is None for a in out.attentions)
        return
    assert len(out.attentions) == config.num_hidden_layers
    batch, length = input_ids.shape
    for weights in out.attentions:
        assert weights.shape == (batch, config.num_attention_heads, length, length)
        for i, row in enumerate(rows):
            real = weights[i, :, -len(row) :, -len(row) :]
            if attention.attention_weights_sum_to_one:
                torch.testing.assert_close(real.sum(-1), torch.ones_like(real.sum(-1)))
            assert torch.all(real.triu(1) == 0), "attention to the future"
            assert torch.all(weights[i, :, -len(row) :, : length - len(row)] == 0), "attention to padding"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_residual_projections_start_scaled(name):
    """GPT-2's init: o_proj and down_proj, which write into the residual stream, start at std / sqrt(2L), the other
    projections at std (`scale_residual_init`). transformers skips `_init_weights` on a module without parameters
    of its own (the decoder layer) for custom-code models, so the scaling must hang on the projections themselves."""
    torch.manual_seed(0)
    variant = VARIANTS[name]
    for scaled in (True, False):
        config = variant.config("tiny", vocab_size=64, scale_residual_init=scaled)  # 2 layers x 64: ratio 1/2
        layer = variant.causal_lm_class(config).model.layers[0]
        expected = (
            config.initializer_range / (2 * config.num_hidden_layers) ** 0.5 if scaled else config.initializer_range
        )
        projections = (layer.self_attn.o_proj,) if layer.mlp is None else (layer.self_attn.o_proj, layer.mlp.down_proj)
        for projection in projections:
            assert projection.weight.std().item() == pytest.approx(expected, rel=0.1), (name, scaled)
        if layer.mlp is not None:  # `mlp_type="none"` (Mamba's blocks) has none
            assert layer.mlp.up_proj.weight.std().item() == pytest.approx(config.initializer_range, rel=0.1)


def test_residual_scaling_defaults_to_the_norms_position():
    """Unset, `scale_residual_init` is on with pre-norm and off with post-norm (a branch's write is normalised with
    the stream after it, and the scaling only shrinks it: a post-norm translator then never read its source); saved
    explicitly, so a checkpoint keeps the init it was built with."""
    variant = VARIANTS["mha"]
    assert variant.config("tiny").scale_residual_init is True
    assert variant.config("tiny", norm_position="post").scale_residual_init is False
    assert variant.config("tiny", norm_position="post", scale_residual_init=True).scale_residual_init is True
    assert variant.config("tiny", norm_position="post").to_dict()["scale_residual_init"] is False


def test_scaled_token_embeddings_start_at_embed_init_std():
    """`embed_init_std` (Marian's 0.02) replaces the scaled tokens' default init std 1/sqrt(d); without
    `scale_embedding` it is refused, naming the field to set."""
    torch.manual_seed(0)
    variant = VARIANTS["mha"]
    for std, expected in ((None, 64**-0.5), (0.02, 0.02)):
        config = variant.config("tiny", vocab_size=512, scale_embedding=True, embed_init_std=std)  # 64 wide
        weight = variant.causal_lm_class(config).get_input_embeddings().weight
        assert weight.std().item() == pytest.approx(expected, rel=0.05)
    with pytest.raises(ValueError, match=r"embed_init_std=0\.02 .*set scale_embedding=True"):
        variant.config("tiny", embed_init_std=0.02)
