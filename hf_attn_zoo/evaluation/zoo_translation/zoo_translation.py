"""Translation quality as an `evaluate` module: corpus BLEU and chrF, computed by sacrebleu.

Load it by path (Hub modules cannot be fetched offline):

    import evaluate, hf_attn_zoo.evaluation
    translation = evaluate.load(hf_attn_zoo.evaluation.TRANSLATION)
    translation.compute(predictions=["the cat sat"], references=[["the cat sat down"]])

Both scores are corpus-level, as sacrebleu's `corpus_bleu` and `corpus_chrf` compute them (BLEU sums n-gram counts
over the corpus before taking precisions; chrF does the same with character n-grams), never means of sentence scores.
The scores are on sacrebleu's 0-100 scale. The module imports only evaluate, datasets and sacrebleu, so it also runs
where the package is not installed.
"""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = """Corpus BLEU (Papineni et al. 2002) and chrF (Popovic 2015; chrF++ with word_order=2) through
sacrebleu, with sacrebleu's signatures so that scores are reported reproducibly."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the system's translations, detokenized.
    references (list of str, or list of list of str): one reference per prediction, or the same number of
        references for every prediction.
    tokenize (str): BLEU's tokenizer (sacrebleu's names: "13a" default, "intl", "char", "none", ...).
    lowercase (bool): case-insensitive BLEU and chrF.
    smooth_method (str): BLEU smoothing, "exp" (default), "floor", "add-k" or "none".
    char_order (int), word_order (int), beta (int): chrF's character and word n-gram orders and recall weight
        (defaults 6, 0, 2; word_order=2 is chrF++).
Returns:
    bleu, chrf (0-100), bleu_precisions, bleu_brevity_penalty, bleu_sys_len, bleu_ref_len, bleu_signature,
    chrf_signature.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ZooTranslation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string"),
                        "references": datasets.Sequence(datasets.Value("string")),
                    }
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(
        self,
        predictions,
        references,
        tokenize="13a",
        lowercase=False,
        smooth_method="exp",
        char_order=6,
        word_order=0,
        beta=2,
    ):
        references = [[reference] if isinstance(reference, str) else list(reference) for reference in references]
        counts = {len(refs) for refs in references}
        if len(counts) > 1:
            raise ValueError(
                f"every prediction needs the same number of references, got {sorted(counts)}; repeat a reference to "
                f"even them out."
            )
        # sacrebleu takes one stream per reference position: references[i][k] becomes streams[k][i]
        streams = [list(stream) for stream in zip(*references)]
        bleu = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method=smooth_method)
        chrf = sacrebleu.metrics.CHRF(char_order=char_order, word_order=word_order, beta=beta, lowercase=lowercase)
        bleu_score = bleu.corpus_score(predictions, streams)
        chrf_score = chrf.corpus_score(predictions, streams)
        return {
            "bleu": bleu_score.score,
            "chrf": chrf_score.score,
            "bleu_precisions": list(bleu_score.precisions),
            "bleu_brevity_penalty": bleu_score.bp,
            "bleu_sys_len": bleu_score.sys_len,
            "bleu_ref_len": bleu_score.ref_len,
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()),
        }
