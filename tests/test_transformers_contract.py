"""What transformers expects of every native model (its `ModelTesterMixin` / `GenerationTesterMixin` checks), held
for every registered variant: packed sequences, flags from the config, output shapes and tuples, loading a base-model
checkpoint, `inputs_embeds` in `generate`, and decoding strategies a variant cannot run refused before any work."""

import contextlib
import copy

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    GenerationConfig,
)

from hf_attn_zoo.models import VARIANTS, modeling_zoo

from conftest import (
    ATOL,
    CACHE_KWARG,
    CASES,
    VOCAB_SIZE,
    left_padded_batch,
    returned_cache,
    tiny_config,
    tiny_model,
)

NAMES = list(VARIANTS)
# variants that decode from running sums (Linformer, AFT): no rollback, so no assisted or prompt-lookup decoding
STATEFUL = [name for name in NAMES if VARIANTS[name].causal_lm_class._is_stateful]
GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


def documents(lengths=(5, 9, 3, 11, 2), seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator) for n in lengths]


def alone(model, docs, **kwargs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(doc[None], use_cache=False, **kwargs).logits[0] for doc in docs]


# packed sequences -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, position", CASES)
def test_packed_documents_equal_each_document_alone(name, position):
    """Padding-free batches (transformers' `DataCollatorWithFlattening`): one row, `position_ids` restarting at 0 at
    each document, no attention mask, no cache. Each document gets exactly what it gets alone."""
    model = tiny_model(name, position)
    docs = documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": doc.tolist()} for doc in docs])
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, sum(map(len, docs)))
    with torch.no_grad():
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone(model, docs)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_packed_rows_in_a_batch_and_chunk_boundaries(name):
    """Two packed rows; documents longer than the kernels' chunks and (sliding window) than twice the window, so the
    banded kernel runs; boundaries fall inside chunks and on them."""
    model = tiny_model(name)
    rows = [documents((4, 17, 8), seed=1), documents((13, 3, 4, 9), seed=2)]  # 29 tokens each
    input_ids = torch.stack([torch.cat(docs) for docs in rows])
    position_ids = torch.stack([torch.cat([torch.arange(len(doc)) for doc in docs]) for docs in rows])
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids, use_cache=False).logits
    for row, docs in enumerate(rows):
        torch.testing.assert_close(packed[row], torch.cat(alone(model, docs)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_packed_training_loss_is_the_loss_of_the_documents(name):
    """Training mode (the fused loss path) on a flattened batch: the loss is the token-weighted mean over the
    documents' own next-token losses, and every parameter gets a gradient."""
    model = tiny_model(name).train()
    docs = documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": doc.tolist()} for doc in docs])
    loss = model(**batch, use_cache=False).loss  # the collator's labels start each document with -100
    with torch.no_grad():
        expected = torch.stack(
            [model(doc[None], labels=doc[None], use_cache=False).loss * (len(doc) - 1) for doc in docs]
        )
    torch.testing.assert_close(loss.detach(), expected.sum() / sum(len(doc) - 1 for doc in docs), atol=ATOL, rtol=0)
    loss.backward()
    assert all(param.grad is not None for param in model.parameters())


def test_packed_sliding_window_dense_and_banded_paths_agree():
    model = tiny_model("sliding_window", sliding_window=3)
    docs = documents((7, 12, 5))
    input_ids, position_ids = torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]
    model.set_attn_implementation("eager")
    with torch.no_grad():  # 24 tokens > 2w: banded kernel; asking for the weights takes the dense mask
        banded = model(input_ids, position_ids=position_ids, use_cache=False).logits
        dense = model(input_ids, position_ids=position_ids, use_cache=False, output_attentions=True)
    torch.testing.assert_close(banded, dense.logits, atol=ATOL, rtol=0)
    for weights in dense.attentions:  # no weight crosses a document boundary
        assert weights[0, :, 7:, :7].abs().max() == 0 and weights[0, :, 19:, :19].abs().max() == 0


def test_packed_linformer_in_the_papers_bidirectional_form():
    model = tiny_model("linformer", is_causal=False)
    docs = documents((6, 10, 4))
    input_ids, position_ids = torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids, use_cache=False).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone(model, docs)), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "name", [name for name in NAMES if VARIANTS[name].model_class.attention_class.mask_type != "dense"]
)
def test_kernels_with_their_own_mask_refuse_a_4d_mask(name):
    model = tiny_model(name)
    input_ids = torch.randint(3, VOCAB_SIZE, (1, 5))
    with pytest.raises(ValueError, match="2D padding mask"):
        model(input_ids, attention_mask=torch.ones(1, 1, 5, 5))


# flags from the config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_output_flags_fall_back_to_the_config(name):
    """`config.output_attentions = True` acts as the keyword does (likewise hidden states, use_cache, return_dict)."""
    model = AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="eager").eval()
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        by_keyword = model(input_ids, attention_mask=attention_mask, output_attentions=True, output_hidden_states=True)
        model.config.output_attentions = model.config.output_hidden_states = True
        by_config = model(input_ids, attention_mask=attention_mask)
        model.config.use_cache, model.config.return_dict = False, False
        as_tuple = model(input_ids, attention_mask=attention_mask)
    assert len(by_config.hidden_states) == model.config.num_hidden_layers + 1
    for a, b in zip(by_config.hidden_states, by_keyword.hidden_states):
        assert torch.equal(a, b)
    if not VARIANTS[name].attention_class.attention_weights_absence(model.config):
        assert len(by_config.attentions) == model.config.num_hidden_layers
        for a, b in zip(by_config.attentions, by_keyword.attentions):
            assert torch.equal(a, b)
    else:  # documented: no attention weights (AFT has none; causal Linformer's change at every step)
        assert all(weights is None for weights in by_config.attentions or ())
    assert returned_cache(by_config) is not None
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 3  # logits, hidden states, attentions: no cache
    for i, row in enumerate(rows):  # without a cache the padding rows take another mask path: real tokens agree
        torch.testing.assert_close(as_tuple[0][i, -len(row) :], by_config.logits[i, -len(row) :], atol=ATOL, rtol=0)
    assert not any(isinstance(item, torch.nn.Module) or hasattr(item, "get_seq_length") for item in as_tuple)


WITHOUT_WEIGHTS = [
    name for name in NAMES if VARIANTS[name].attention_class.attention_weights_absence(tiny_config(name))
]


@pytest.mark.parametrize("name", WITHOUT_WEIGHTS)
def test_attention_weights_asked_for_and_absent_are_said_once(name, caplog):
    """`output_attentions=True` on a variant with no weights over the tokens warns once, naming it and why, rather
    than returning empty attentions in silence."""
    model = tiny_model(name)
    type(modeling_zoo.logger).warning_once.cache_clear()  # transformers' once-per-process memory of messages
    with caplog.at_level("WARNING", logger="hf_attn_zoo"), torch.no_grad():
        for _ in range(2):
            assert not model(torch.tensor([[5, 6, 7]]), output_attentions=True).attentions
    said = [r.getMessage() for r in caplog.records if "has no attention weights" in r.getMessage()]
    reason = VARIANTS[name].attention_class.attention_weights_absence(model.config)
    assert said == [
        f"output_attentions=True, but {model.config.model_type} has no attention weights to return: "
        f"{reason}; the output's `attentions` stays empty."
    ]


UNDECLARED = [
    (name, backend)
    for name in NAMES
    for backend in ("sdpa", "flash_attention_2", "flex_attention")
    if backend not in VARIANTS[name].backends
]


@pytest.mark.parametrize("name, backend", UNDECLARED)
def test_an_undeclared_backend_is_refused_with_the_variants_reason(name, backend):
    """transformers' own refusal asks users to request support on its tracker; the variant says why instead, when
    the model is built and when the backend is switched."""
    config = tiny_config(name)
    expected = rf"^{config.model_type} .*not through transformers' '{backend}' attention function; load it with "
    expected += r"attn_implementation in \['eager'"
    with pytest.raises(ValueError, match=expected):
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=backend)
    model = tiny_model(name)
    with pytest.raises(ValueError, match=expected):
        model.set_attn_implementation(backend)
    assert model.config._attn_implementation in VARIANTS[name].backends  # unchanged


@pytest.mark.parametrize("name", NAMES)
def test_return_dict_false_gives_tuples_for_the_base_model_too(name):
    model = tiny_model(name)
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        as_dict = model.model(input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
        as_tuple = model.model(
            input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True, return_dict=False
        )
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], as_dict.last_hidden_state)
    assert len(as_tuple[1]) == model.config.num_hidden_layers + 1


@pytest.mark.parametrize("name", ["gqa", "aft_simple", "mla"])
def test_the_cache_is_taken_under_either_name(name):
    """`cache=` on every release and `past_key_values=`, transformers' name before 5.24 (deprecated from it), decode
    the same step from the same cache."""
    model = tiny_model(name)
    input_ids = torch.randint(3, VOCAB_SIZE, (2, 9))
    with torch.no_grad(), pytest.warns(FutureWarning) if CACHE_KWARG == "cache" else contextlib.nullcontext():
        steps = []
        for keyword in ("cache", "past_key_values"):
            prefix = returned_cache(model(input_ids[:, :-1], use_cache=True))
            steps.append(model(input_ids[:, -1:], use_cache=True, **{keyword: prefix}).logits)
    whole = model(input_ids).logits[:, -1:]
    torch.testing.assert_close(steps[0], whole, atol=ATOL, rtol=0)
    assert torch.equal(steps[0], steps[1])  # the same cache and the same step: bit-identical


# loading ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_base_model_checkpoint_loads_into_the_causal_lm(name, tmp_path):
    lm = tiny_model(name, tie_word_embeddings=False)
    lm.model.save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"} and not info["mismatched_keys"]
    for key, tensor in lm.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[key], tensor), key
    assert model.lm_head.weight.abs().sum() > 0  # initialised by _init_weights, not left empty


OFFLOADED = [(name, {}) for name in NAMES] + [("linformer", {"linformer_sharing": "layerwise"})]


@pytest.mark.parametrize("name, fields", OFFLOADED, ids=lambda x: x if isinstance(x, str) else "-".join(x.values()))
def test_offloaded_loading_gives_the_same_logits_and_tokens(name, fields, tmp_path):
    """accelerate's big-model inference: with `device_map="auto"` and a memory budget the decoder layers do not fit,
    they go to disk, their weights on the meta device but around their modules' own forwards. Every parameter must
    be read inside the forward of the module that owns it."""
    torch.manual_seed(0)
    model = VARIANTS[name].causal_lm_class(tiny_config(name, **fields)).eval()
    model.save_pretrained(tmp_path / "model")
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 // 5  # embeddings fit, layers do not
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    ).eval()
    placed = offloaded.hf_device_map
    assert "cpu" in placed.values() and any(where == "disk" for module, where in placed.items() if "layers" in module)
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(offloaded(input_ids, attention_mask=attention_mask).logits, expected)
    # every forward reads the offloaded weights back from disk: three new tokens show decoding (MLA's absorbed step)
    greedy = {"attention_mask": attention_mask, "max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(offloaded.generate(input_ids, **greedy), model.generate(input_ids, **greedy))


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_shape_names_the_fields_the_owning_module_declares(name, tmp_path):
    model = tiny_model(name)
    model.save_pretrained(tmp_path)
    # the MLP's first projection; without an MLP (`mlp_type="none"`, Mamba) the mixer's, which intermediate_size sizes
    owner, projection = ("mlp", "up_proj") if model.model.layers[0].mlp is not None else ("self_attn", "in_proj")
    rows = 48 if owner == "mlp" else 2 * 48  # Mamba's in_proj holds x and the gate
    config = AutoConfig.from_pretrained(tmp_path)
    config.intermediate_size = 48
    with pytest.raises(ValueError, match=rf"{owner}\.{projection}\.weight.*sized by intermediate_size, hidden_size"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=config)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, config=config, ignore_mismatched_sizes=True)
    assert getattr(getattr(model.model.layers[0], owner), projection).weight.shape == (rows, 32)


@pytest.mark.parametrize(
    "name, field, value, sized_by",
    [
        ("linformer", "linformer_k", 7, "linformer_k, max_position_embeddings"),
        ("additive", "additive_dim", 4, "num_key_value_heads, additive_dim, hidden_size"),
        ("aft_full", "aft_bias_rank", 2, "max_position_embeddings, aft_bias_rank"),
        ("gqa", "num_key_value_heads", 1, "num_key_value_heads, head_dim, hidden_size"),
    ],
)
def test_variant_tensors_name_their_own_fields(name, field, value, sized_by, tmp_path):
    tiny_model(name).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"sized by {sized_by}"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=config)


# configuration ----------------------------------------------------------------------------------------------------
NON_ROPE = [case for case in CASES if case.values[1] != "rope"]


@pytest.mark.parametrize("name, position", NON_ROPE)
def test_only_rope_configurations_carry_rope_parameters(name, position, tmp_path):
    assert tiny_config(name, position).rope_parameters is None
    for settings in (
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0}),
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        dict(rope_theta=500000.0),
    ):
        with pytest.raises(ValueError, match="rope_parameters"):
            tiny_config(name, position, **settings)
    # checkpoints written before carried transformers' default RoPE parameters: they load, without them
    model = tiny_model(name, position)
    model.save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    default = '"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}'
    (tmp_path / "config.json").write_text(saved.replace('"rope_parameters": null', default))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters is None


def test_rope_parameters_set_after_construction_are_checked_by_the_model():
    config = tiny_config("gqa", "alibi")
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_parameters"):
        AutoModelForCausalLM.from_config(config)


# generation -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_generate_from_inputs_embeds(name):
    model = tiny_model(name)
    input_ids, attention_mask, _ = left_padded_batch()
    from_ids = model.generate(input_ids, attention_mask=attention_mask, generation_config=GREEDY)
    embeds = model.get_input_embeddings()(input_ids)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=attention_mask, generation_config=GREEDY)
    assert torch.equal(from_embeds, from_ids[:, input_ids.shape[1] :])  # only the new tokens, as transformers does


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("strategy", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_is_refused_before_any_work_on_state_variants(name, strategy):
    model = tiny_model(name)
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    option = {"assistant_model": copy.deepcopy(model)} if strategy == "assistant_model" else {strategy: 2}
    input_ids, _, _ = left_padded_batch(lengths=(7,))
    with pytest.raises(ValueError, match="stateful"):
        model.generate(input_ids, generation_config=GREEDY, **option)
    assert not calls, "the model ran before the refusal"


@pytest.mark.parametrize("name", [name for name in NAMES if name not in STATEFUL])
def test_assisted_decoding_gives_the_greedy_tokens(name):
    model, assistant = tiny_model(name), tiny_model(name, seed=1)  # a different assistant: candidates get rejected
    input_ids, _, _ = left_padded_batch(lengths=(7,))
    greedy = model.generate(input_ids, generation_config=GREEDY)
    assert torch.equal(model.generate(input_ids, generation_config=GREEDY, assistant_model=assistant), greedy)
    if Version(transformers.__version__) >= Version("5.3"):  # before, prompt lookup fails on eos_token_id=None
        assert torch.equal(model.generate(input_ids, generation_config=GREEDY, prompt_lookup_num_tokens=2), greedy)


def test_a_non_causal_linformer_refuses_to_generate():
    model = tiny_model("linformer", is_causal=False)
    with pytest.raises(ValueError, match="is_causal=False"):
        model.generate(torch.randint(3, VOCAB_SIZE, (1, 4)), generation_config=GREEDY)
