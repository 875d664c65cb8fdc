"""Attention maps: the weights one head gives each earlier token, as a labelled heatmap (tokens on both axes).

    from hf_attn_zoo.evaluation import plot_attention
    plot_attention(model, tokenizer, "The quick brown fox", layer=0, head=3, path="map.png")

or `hf-attn-zoo attention CHECKPOINT "text" --layer 0 --head 3 --out map.png`. The weights are what the model returns
with `output_attentions=True`, computed on the eager path (fused kernels such as sdpa never form them). Variants
without attention weights (the AFT family and causal Linformer, whose outputs are not a weighted average over
tokens) raise `ValueError` saying so; sliding window, top-k and additive attention show their sparsity patterns.
"""

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
