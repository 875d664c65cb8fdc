"""Attention maps: the weights one head gives each earlier token, as a labelled heatmap (tokens on both axes).

    from hf_attn_zoo.evaluation import plot_attention
    plot_attention(model, tokenizer, "The quick brown fox", layer=0, head=3, path="map.png")

or `hf-attn-zoo attention CHECKPOINT "text" --layer 0 --head 3 --out map.png`. The weights are what the model returns
with `output_attentions=True`, computed on the eager path (fused kernels such as sdpa never form them). Variants
without attention weights (the AFT family and causal Linformer, whose outputs are not a weighted average over
tokens) raise `ValueError` saying so; sliding window, top-k and additive attention show their sparsity patterns.

A sequence-to-sequence model gets the alignment figure instead (`plot_cross_attention`): the sentence is translated
with `generate()` and the decoder's weights over the source tokens are drawn per head, source along x and the
translation along y (the RNN translator's Bahdanau or Luong attention is one head).
"""

import math
from pathlib import Path

import torch

from ..models import VARIANTS
from .plotting import headless_pyplot, house_style, save_figure


def attention_map(model, tokenizer, text: str, layer: int = 0, head: int = 0) -> tuple[list[str], torch.Tensor]:
    """(tokens, `(T, T)` weights of `head` in `layer`) for `text`; row i is query token i."""
    config = model.config
    if not -config.num_hidden_layers <= layer < config.num_hidden_layers:
        raise ValueError(f"layer={layer} is out of range: the model has num_hidden_layers={config.num_hidden_layers}")
    if not -config.num_attention_heads <= head < config.num_attention_heads:
        raise ValueError(
            f"head={head} is out of range: the model has num_attention_heads={config.num_attention_heads}"
        )
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    backend = config._attn_implementation
    model.set_attn_implementation("eager")  # fused kernels return no weights
    try:
        with torch.no_grad():
            attentions = model(**inputs, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(backend)
    if not attentions or attentions[layer] is None:
        with_weights = [
            name
            for name, variant in VARIANTS.items()
            if not variant.attention_class.attention_weights_absence(variant.config())  # at its defaults
        ]
        raise ValueError(
            f"{config.model_type} computes no attention weights (its output is not a weighted average over tokens), "
            f"so there is no map to draw; these variants have one: {', '.join(with_weights)}."
        )
    tokens = [tokenizer.decode([token]) for token in inputs.input_ids[0].tolist()]
    return tokens, attentions[layer][0, head].float().cpu()  # (B, H, T, T) -> (T, T)


def plot_attention(model, tokenizer, text: str, layer: int = 0, head: int = 0, path: str | Path | None = None):
    """A heatmap of `attention_map(...)`: keys along x, queries along y, tokens as tick labels; saved to `path`
    (PNG, or any format matplotlib infers from the suffix) when given. Returns the matplotlib figure."""
    if path is not None:
        headless_pyplot()  # a file, not a window: works without a display
    from matplotlib import pyplot as plt

    tokens, weights = attention_map(model, tokenizer, text, layer, head)
    labels = [repr(token)[1:-1] or "␣" for token in tokens]  # visible whitespace and control characters
    size = min(4 + 0.3 * len(tokens), 24)
    with house_style():
        figure, axis = plt.subplots(figsize=(size + 1.5, size))
        image = axis.imshow(weights.numpy(), cmap="viridis", vmin=0.0)
        axis.grid(False)  # a grid over a heatmap hides cells
        axis.set_xticks(range(len(labels)), labels, rotation=90)
        axis.set_yticks(range(len(labels)), labels)
        axis.set(
            xlabel="key (token attended to)",
            ylabel="query (token)",
            title=f"{model.config.model_type}: layer {layer}, head {head}",
        )
        figure.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label="attention weight (probability)")
        if path is not None:
            save_figure(figure, path, dpi=120)
        else:
            figure.tight_layout()
    return figure


def cross_attention_map(
    model, tokenizer, text: str, layer: int = 0, num_beams: int = 1
) -> tuple[list[str], list[str], torch.Tensor]:
    """(source tokens, target tokens, `(H, T, S)` cross-attention weights of `layer`) of a sequence-to-sequence
    model translating `text`: row t holds the weights the decoder gave the source when it wrote target token t (it
    reads the tokens before t: the translation, shifted behind the decoder's start token, is fed back)."""
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    backend = getattr(model.config, "_attn_implementation", None)
    switch = backend not in (None, "eager")  # fused kernels return no weights; an RNN has no backend to switch
    if switch:
        model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            generated = model.generate(**inputs, num_beams=num_beams, do_sample=False)  # (1, 1 + T)
            outputs = model(**inputs, decoder_input_ids=generated[:, :-1], output_attentions=True)
    finally:
        if switch:
            model.set_attn_implementation(backend)
    attentions = outputs.cross_attentions
    if not attentions or attentions[0] is None:
        raise ValueError(
            f"{model.config.model_type} returns no cross-attention weights (a decoder without attention over the "
            f"source, such as zoo_rnn with attention='none'), so there is no alignment to draw."
        )
    if not -len(attentions) <= layer < len(attentions):
        raise ValueError(f"layer={layer} is out of range: the decoder has {len(attentions)} cross-attention layer(s)")
    sources = [tokenizer.decode([token]) for token in inputs.input_ids[0].tolist()]
    targets = [tokenizer.decode([token]) for token in generated[0, 1:].tolist()]
    return sources, targets, attentions[layer][0].float().cpu()  # (B, H, T, S) -> (H, T, S)


def plot_cross_attention(
    model, tokenizer, text: str, layer: int = 0, head: int | None = None, path: str | Path | None = None
):
    """The alignment figure of Bahdanau et al. (2015): one heatmap per head of `cross_attention_map(...)` (or only
    `head`), source tokens along x, the translation's tokens along y; saved to `path` when given. Returns the
    matplotlib figure."""
    if path is not None:
        headless_pyplot()
    from matplotlib import pyplot as plt

    sources, targets, weights = cross_attention_map(model, tokenizer, text, layer)
    heads = range(weights.shape[0]) if head is None else [head]
    if head is not None and not -weights.shape[0] <= head < weights.shape[0]:
        raise ValueError(f"head={head} is out of range: the cross-attention has {weights.shape[0]} head(s)")
    columns = min(len(heads), 4)
    rows = math.ceil(len(heads) / columns)
    source_labels = [repr(token)[1:-1] or "␣" for token in sources]
    target_labels = [repr(token)[1:-1] or "␣" for token in targets]
    width = min(2 + 0.35 * len(sources), 12)
    height = min(1.5 + 0.35 * len(targets), 12)
    with house_style():
        figure, axes = plt.subplots(
            rows, columns, figsize=(width * columns + 1.5, height * rows), squeeze=False, layout="constrained"
        )
        for axis in axes.flat[len(heads) :]:
            axis.set_visible(False)
        for axis, index in zip(axes.flat, heads):
            image = axis.imshow(weights[index].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            axis.grid(False)  # a grid over a heatmap hides cells
            axis.set_xticks(range(len(source_labels)), source_labels, rotation=90)
            axis.set_yticks(range(len(target_labels)), target_labels)
            axis.set(xlabel="source token", ylabel="translation token", title=f"head {index}")
        figure.suptitle(f"{model.config.model_type}: cross-attention of layer {layer}")
        figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04, label="attention weight (probability)")
        if path is not None:
            save_figure(figure, path, dpi=120)
    return figure
