"""Evaluation: the perplexity harness and the translation metrics BLEU and chrF (`evaluate` modules shipped here),
lm-evaluation-harness tasks over local files, attention maps, and the plotting helpers they share. The experiments
(speed, scaling, decode, int8, uptraining, the quality board) are scripts in the repository's experiments/ folder,
not part of the package."""

from pathlib import Path

from .attention_maps import attention_map, cross_attention_map, plot_attention, plot_cross_attention
from .perplexity import PerplexityResult, score_texts

# `evaluate.load(PERPLEXITY)` loads the shipped module by path: Hub modules cannot be fetched offline.
PERPLEXITY = str(Path(__file__).resolve().parent / "zoo_perplexity")
# `evaluate.load(TRANSLATION)`: corpus BLEU and chrF through sacrebleu, loaded by path for the same reason.
TRANSLATION = str(Path(__file__).resolve().parent / "zoo_translation")

__all__ = [
    "PERPLEXITY",
    "TRANSLATION",
    "PerplexityResult",
    "attention_map",
    "cross_attention_map",
    "plot_attention",
    "plot_cross_attention",
    "score_texts",
]
