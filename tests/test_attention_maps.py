"""Attention maps: the weights of one head, and the heatmap drawn from them."""

import pytest
import torch

from hf_attn_zoo.evaluation import attention_map, plot_attention
from hf_attn_zoo_cli import main

from test_integrations import byte_model

pytest.importorskip("matplotlib")

TEXT = "attention, mapped"


@pytest.mark.parametrize("name", ["gqa", "sliding_window", "topk", "additive"])
def test_attention_map_is_a_causal_distribution_per_query(name):
    model, tokenizer = byte_model(name)
    model.eval()
    backend = model.config._attn_implementation
    tokens, weights = attention_map(model, tokenizer, TEXT, layer=1, head=2)
    assert model.config._attn_implementation == backend  # the eager detour is undone
    assert "".join(tokens) == TEXT and weights.shape == (len(TEXT), len(TEXT))
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(TEXT)))
    assert torch.all(weights.triu(1) == 0)  # nothing from the future
    if name == "sliding_window":  # nothing from beyond the window either
        assert torch.all(weights.tril(-model.config.sliding_window) == 0)
    if name == "topk":
        assert int((weights > 0).sum(-1).max()) == model.config.topk


def test_plot_attention_writes_a_labelled_heatmap(tmp_path):
    model, tokenizer = byte_model("mha")
    figure = plot_attention(model.eval(), tokenizer, TEXT, layer=0, head=1)
    axis = figure.axes[0]
    assert [label.get_text() for label in axis.get_yticklabels()][:3] == ["a", "t", "t"]
    assert len(axis.get_xticklabels()) == len(TEXT) and "layer 0, head 1" in axis.get_title()
    path = tmp_path / "map.png"
    plot_attention(model, tokenizer, TEXT, layer=-1, head=0, path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["aft_simple", "linformer"])
def test_variants_without_weights_say_so(name):
    model, tokenizer = byte_model(name)
    with pytest.raises(ValueError, match="computes no attention weights"):
        attention_map(model.eval(), tokenizer, TEXT)


def test_layer_and_head_out_of_range():
    model, tokenizer = byte_model("gqa")
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        attention_map(model, tokenizer, TEXT, layer=2)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        attention_map(model, tokenizer, TEXT, head=4)


def test_attention_command(tmp_path, capsys):
    model, tokenizer = byte_model("sliding_window")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "map.png"
    main(["attention", str(tmp_path / "model"), TEXT, "--head", "3", "--out", str(out)])
    assert out.is_file() and "head 3" in capsys.readouterr().out
