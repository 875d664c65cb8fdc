"""Perplexity as an `evaluate` module, for any causal LM: corpus-level, token-weighted, with sliding windows.

Load it by path (Hub modules cannot be fetched offline):

    import evaluate, hf_attn_zoo.evaluation
    perplexity = evaluate.load(hf_attn_zoo.evaluation.PERPLEXITY)
    perplexity.compute(predictions=texts, model=model_or_path, tokenizer=tokenizer, max_length=2048, stride=512)

`model` is a model object or a checkpoint path or name (loaded through the Auto classes, with `trust_remote_code`
and `gguf_file` passed through); `tokenizer` defaults to the checkpoint's. The scoring itself is
`hf_attn_zoo.evaluation.perplexity.score_texts`.
"""

import datasets
import evaluate

from hf_attn_zoo.evaluation.perplexity import load_for_scoring, score_texts

_DESCRIPTION = """Corpus-level token perplexity (exp of total NLL over total predicted tokens), bits per byte and word
perplexity (lm-evaluation-harness definitions), scored with sliding windows so every token counts once."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts to score.
    model: a causal LM, or a checkpoint path or name.
    tokenizer: its tokenizer (default: loaded from the checkpoint).
    max_length (int): tokens of context per window (default: the model's max_position_embeddings).
    stride (int): tokens between window starts, at most max_length (default: max_length, disjoint windows).
    batch_size (int): windows per forward; does not change the result.
    add_bos (bool): prepend the BOS token (default: when the tokenizer has one).
    trust_remote_code (bool), gguf_file (str), dtype: passed to from_pretrained when `model` is a path.
Returns:
    perplexity, bits_per_byte, word_perplexity, nll, tokens, bytes, words, max_length, stride.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ZooPerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(
        self,
        predictions,
        model=None,
        tokenizer=None,
        max_length=None,
        stride=None,
        batch_size=1,
        add_bos=None,
        trust_remote_code=False,
        gguf_file=None,
        dtype=None,
        progress=False,
    ):
        if model is None:
            raise ValueError("pass model=: a causal LM or a checkpoint path or name")
        if isinstance(model, str):
            model, loaded_tokenizer = load_for_scoring(model, trust_remote_code, gguf_file, dtype)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("pass tokenizer= with a model object")
        result = score_texts(model, tokenizer, predictions, max_length, stride, batch_size, add_bos, progress)
        return result.as_dict()
