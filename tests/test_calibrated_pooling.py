"""Calibrated MHA -> GQA/MQA conversions (`hf_attn_zoo/convert/calibrated.py`): the head rewrites they fold into the
projections change nothing by themselves; aligned pooling undoes rotations between heads, grouped pooling finds the
heads that belong together; both are exact where they must be, and bad calibration is named."""

import pytest
import torch

from hf_attn_zoo.convert import mha_to_gqa
from hf_attn_zoo.convert.calibrated import HeadRewrite, plane_rotations, procrustes
from hf_attn_zoo.data import byte_level_tokenizer

from conftest import ATOL, assert_loads_without_the_package, left_padded_batch, tiny_model

HEADS, HEAD_DIM = 4, 8  # the tiny MHA model's
CALIBRATION = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))  # 128 tokens >= 4 x 8


def logits(model) -> torch.Tensor:
    input_ids, attention_mask, _ = left_padded_batch()
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits


def random_orthogonal(dim: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
    return q * r.diagonal().sign()


def random_plane_rotation(dim: int, generator: torch.Generator) -> torch.Tensor:
    """A map that commutes with RoPE: one 2-D rotation per frequency plane (channels i, i + d/2), by a random angle,
    built as its action on the identity's rows read as complex numbers (row i times e^{i angle})."""
    half = dim // 2
    angles = torch.rand(half, generator=generator, dtype=torch.float64) * 6.28
    identity = torch.eye(dim, dtype=torch.float64)
    z = torch.complex(identity[:, :half], identity[:, half:]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), -1)


def rewrite_model(model, make_rewrite) -> None:
    """Apply `make_rewrite(layer_index)`'s HeadRewrite to every layer of `model`, in place."""
    state = model.state_dict()
    for index in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{index}.self_attn."
        attention = {name[len(prefix) :]: tensor for name, tensor in state.items() if name.startswith(prefix)}
        for name, tensor in make_rewrite(index).apply(attention).items():
            state[prefix + name] = tensor
    model.load_state_dict(state)


def random_rewrite(generator: torch.Generator, rope: bool, permute: bool) -> HeadRewrite:
    rewrite = HeadRewrite(HEADS, HEADS, HEAD_DIM, HEAD_DIM)
    if permute:
        rewrite.order = torch.randperm(HEADS, generator=generator).tolist()
    for head in range(HEADS):
        key_map = random_plane_rotation if rope else random_orthogonal
        rewrite.key_maps[head] = key_map(HEAD_DIM, generator)
        rewrite.value_maps[head] = random_orthogonal(HEAD_DIM, generator)
    return rewrite


def copy_heads_within(model, groups: list[list[int]]) -> None:
    """Make the key/value heads of each group equal (weights and biases) to the group's first."""
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for tensor in (projection.weight, projection.bias):
                    per_head = tensor.view(HEADS, HEAD_DIM, *tensor.shape[1:])
                    for group in groups:
                        for head in group[1:]:
                            per_head[head].copy_(per_head[group[0]])


@pytest.mark.parametrize("position", ["rope", "alibi", "none"])
def test_a_folded_rewrite_leaves_the_model_unchanged(position):
    """Rotating each head's keys (and its queries alike), its values (undone in o_proj) and reordering heads with
    their queries is the same function: what the calibrated methods do before pooling. ALiBi keeps the order."""
    model = tiny_model("mha", position, attention_bias=True)
    expected = logits(model)
    generator = torch.Generator().manual_seed(1)
    rewrite_model(model, lambda _: random_rewrite(generator, position == "rope", permute=position != "alibi"))
    torch.testing.assert_close(logits(model), expected, atol=ATOL, rtol=0)


def test_the_fits_recover_known_maps():
    generator = torch.Generator().manual_seed(2)
    source = torch.randn(200, HEAD_DIM, generator=generator, dtype=torch.float64)
    rotation = random_orthogonal(HEAD_DIM, generator)
    torch.testing.assert_close(procrustes(source, source @ rotation), rotation)
    planes = random_plane_rotation(HEAD_DIM, generator)
    torch.testing.assert_close(plane_rotations(source, source @ planes), planes)
    assert torch.allclose(planes @ planes.T, torch.eye(HEAD_DIM, dtype=torch.float64))


@pytest.mark.parametrize("position", ["rope", "none"])
@pytest.mark.parametrize("groups", [2, 1])
def test_aligned_pooling_undoes_rotations_between_heads(position, groups):
    """Heads equal up to rotations within each group (equal, then rotated by a folded rewrite, so the model is
    unchanged): mean pooling loses them, aligned pooling converts exactly."""
    model = tiny_model("mha", position, attention_bias=True)
    size = HEADS // groups
    copy_heads_within(model, [list(range(start, start + size)) for start in range(0, HEADS, size)])
    expected = logits(model)
    generator = torch.Generator().manual_seed(3)
    rewrite_model(model, lambda _: random_rewrite(generator, position == "rope", permute=False))
    aligned = mha_to_gqa(model, groups, "aligned", calibration=CALIBRATION)
    torch.testing.assert_close(logits(aligned), expected, atol=ATOL, rtol=0)
    assert not torch.allclose(logits(mha_to_gqa(model, groups, "mean")), expected, atol=1e-3)
    assert sum(p.numel() for p in aligned.parameters()) == sum(
        p.numel() for p in mha_to_gqa(model, groups).parameters()
    )


def test_grouped_pooling_finds_the_heads_that_belong_together():
    """Heads 0 = 2 and 1 = 3: contiguous groups (0, 1), (2, 3) mix different heads; grouping pairs the equal ones
    and converts exactly, moving the query heads along."""
    model = tiny_model("mha", "rope", attention_bias=True)
    copy_heads_within(model, [[0, 2], [1, 3]])
    expected = logits(model)
    grouped = mha_to_gqa(model, 2, "grouped", calibration=CALIBRATION)
    torch.testing.assert_close(logits(grouped), expected, atol=ATOL, rtol=0)
    assert not torch.allclose(logits(mha_to_gqa(model, 2, "mean")), expected, atol=1e-3)


def test_grouped_aligned_pairs_heads_that_differ_by_a_rotation():
    """Heads 0 ~ 2 and 1 ~ 3 up to rotations: raw distances cannot see it, the distance left after aligning can;
    grouping by it and aligning the pairs converts exactly."""
    model = tiny_model("mha", "rope", attention_bias=True)
    copy_heads_within(model, [[0, 2], [1, 3]])
    expected = logits(model)
    generator = torch.Generator().manual_seed(4)
    rewrite_model(model, lambda _: random_rewrite(generator, rope=True, permute=False))
    converted = mha_to_gqa(model, 2, "grouped_aligned", calibration=CALIBRATION)
    torch.testing.assert_close(logits(converted), expected, atol=ATOL, rtol=0)
    assert not torch.allclose(logits(mha_to_gqa(model, 2, "aligned", calibration=CALIBRATION)), expected, atol=1e-3)


@pytest.mark.parametrize("method", ["aligned", "grouped", "grouped_aligned"])
def test_as_many_groups_as_heads_is_the_identity(method):
    model = tiny_model("mha", attention_bias=True)
    assert torch.equal(logits(mha_to_gqa(model, HEADS, method, calibration=CALIBRATION)), logits(model))


def test_calibration_texts_are_read_with_the_tokenizer():
    model = tiny_model("mha", vocab_size=258)
    text = "def pooled(heads):\n    return sum(heads) / len(heads)\n" * 8
    converted = mha_to_gqa(model, 2, "aligned", calibration=[text], tokenizer=byte_level_tokenizer())
    assert converted.config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="tokenizer"):
        mha_to_gqa(model, 2, "aligned", calibration=[text])


def test_bad_calibration_is_named():
    model = tiny_model("mha")
    with pytest.raises(ValueError, match=r"calibration=None"):
        mha_to_gqa(model, 2, "aligned")
    with pytest.raises(ValueError, match=r"calibration gives 10 tokens.*at least 32"):
        mha_to_gqa(model, 2, "grouped", calibration=CALIBRATION[:1, :10])
    with pytest.raises(ValueError, match=r"calibration gives 0 tokens"):
        mha_to_gqa(model, 2, "aligned", calibration=[])
    with pytest.raises(ValueError, match="calibration is read by the calibrated methods"):
        mha_to_gqa(model, 2, "mean", calibration=CALIBRATION)
    for method in ("grouped", "grouped_aligned"):
        with pytest.raises(ValueError, match="ALiBi"):
            mha_to_gqa(tiny_model("mha", "alibi"), 2, method, calibration=CALIBRATION)


def test_convert_command_fits_on_calibration_files(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_attn_zoo_cli import main

    model = tiny_model("mha", vocab_size=258)
    model.save_pretrained(tmp_path / "mha")
    byte_level_tokenizer().save_pretrained(tmp_path / "mha")
    (tmp_path / "calibration.txt").write_text("Calibration text, not the test text. " * 20)
    args = ["convert", str(tmp_path / "mha"), str(tmp_path / "gqa"), "--to", "gqa", "--num_key_value_heads", "2"]
    assert main([*args, "--method", "aligned", "--calibration", str(tmp_path / "calibration.txt")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa")
    assert converted.config.num_key_value_heads == 2
    card = (tmp_path / "gqa" / "README.md").read_text()
    assert "aligned-pooled" in card and "calibration.txt" in card
    capsys.readouterr()
    assert main([*args[:2], str(tmp_path / "grouped"), *args[3:], "--method", "grouped"]) == 2
    assert "--calibration FILE" in capsys.readouterr().err
    assert main([*args[:2], str(tmp_path / "x"), *args[3:], "--calibration", str(tmp_path / "calibration.txt")]) == 2
    assert "--calibration is read by --method aligned / grouped / grouped_aligned, not mean" in capsys.readouterr().err
    assert not (tmp_path / "grouped").exists() and not (tmp_path / "x").exists()


def test_a_calibrated_conversion_loads_where_the_package_is_absent(tmp_path):
    """Permuted query heads and folded rotations are plain weights: the saved GQA model needs nothing new to load."""
    converted = mha_to_gqa(tiny_model("mha"), 2, "grouped_aligned", calibration=CALIBRATION)
    converted.save_pretrained(tmp_path / "gqa")
    assert_loads_without_the_package(tmp_path / "gqa", tmp_path)


def test_calibration_stops_at_its_token_budget():
    from hf_attn_zoo.convert.calibrated import calibration_batches

    batches = calibration_batches([list(range(50)), list(range(50)), list(range(50))], None, 16, max_tokens=70)
    assert [batch.shape for batch in batches] == [(1, 16)] * 3 + [(1, 2)] + [(1, 16), (1, 4)]
    assert sum(batch.numel() for batch in batches) == 70
    assert calibration_batches(["never read"], None, 16, max_tokens=0) == []  # no tokenizer needed: nothing read


def test_the_command_line_offers_every_method():
    """The command line's options live apart from the package (fast --help): its method list must not drift."""
    import typing

    from hf_attn_zoo.convert import METHODS, MLA_METHODS
    from hf_attn_zoo_cli import ConvertOptions

    # the annotation, not the dataclass field's type, which transformers' HfArgumentParser rewrites when it parses
    choices, none = typing.get_args(typing.get_type_hints(ConvertOptions)["method"])  # Literal[...] | None
    assert typing.get_args(choices) == tuple(dict.fromkeys((*METHODS, *MLA_METHODS))) and none is type(None)
