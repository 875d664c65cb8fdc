"""Evaluation: the perplexity harness (an `evaluate` module shipped here), attention maps, speed and scaling
benchmarks."""

from pathlib import Path

from .attention_maps import attention_map, plot_attention
from .perplexity import PerplexityResult, score_texts

# `evaluate.load(PERPLEXITY)` loads the shipped module by path: Hub modules cannot be fetched offline.
PERPLEXITY = str(Path(__file__).resolve().parent / "zoo_perplexity")

__all__ = ["PERPLEXITY", "PerplexityResult", "attention_map", "plot_attention", "score_texts"]
