"""The shipped translation metric (`hf_attn_zoo.evaluation.TRANSLATION`): sacrebleu's corpus BLEU and chrF."""

from pathlib import Path

import evaluate
import pytest
import sacrebleu

from hf_attn_zoo.evaluation import TRANSLATION

BIBLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "bible_en_es" / "pairs.tsv"

PREDICTIONS = [
    "The cat sat on the mat.",
    "There is a dog in the garden, barking loudly.",
    "He read the book yesterday",
    "completely unrelated words here",
]
REFERENCES = [
    "The cat is sitting on the mat.",
    "A dog is barking loudly in the garden.",
    "He read the book yesterday.",
    "She sings beautifully.",
]
SECOND_REFERENCES = [
    "A cat sat on the mat.",
    "In the garden a dog barks loudly.",
    "Yesterday he read the book.",
    "Her singing is beautiful.",
]


@pytest.fixture(scope="module")
def metric():
    return evaluate.load(TRANSLATION)


def test_equals_sacrebleu_called_directly(metric):
    result = metric.compute(predictions=PREDICTIONS, references=REFERENCES)
    bleu = sacrebleu.corpus_bleu(PREDICTIONS, [REFERENCES])
    assert result["bleu"] == pytest.approx(bleu.score, abs=1e-9)
    assert result["bleu_precisions"] == pytest.approx(bleu.precisions, abs=1e-9)
    assert (result["bleu_sys_len"], result["bleu_ref_len"]) == (bleu.sys_len, bleu.ref_len)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(PREDICTIONS, [REFERENCES]).score, abs=1e-9)
    assert 0 < result["bleu"] < 100 and 0 < result["chrf"] < 100
    assert result["bleu_signature"].startswith("nrefs:1|")


def test_several_references_and_options_equal_sacrebleu(metric):
    references = [[first, second] for first, second in zip(REFERENCES, SECOND_REFERENCES)]
    result = metric.compute(predictions=PREDICTIONS, references=references, lowercase=True, word_order=2)
    streams = [REFERENCES, SECOND_REFERENCES]
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(PREDICTIONS, streams, lowercase=True).score)
    chrf_plus_plus = sacrebleu.metrics.CHRF(word_order=2, lowercase=True).corpus_score(PREDICTIONS, streams)
    assert result["chrf"] == pytest.approx(chrf_plus_plus.score)


def test_a_perfect_translation_scores_100(metric):
    result = metric.compute(predictions=REFERENCES, references=REFERENCES)
    assert result["bleu"] == pytest.approx(100.0) and result["chrf"] == pytest.approx(100.0)


def test_uneven_reference_counts_are_refused(metric):
    with pytest.raises(ValueError, match="same number of references"):
        metric.compute(predictions=PREDICTIONS[:2], references=[[REFERENCES[0]], REFERENCES[1:3]])


@pytest.mark.skipif(not BIBLE.is_file(), reason="the English/Spanish verse pairs are not on this machine")
def test_real_spanish_verses_equal_sacrebleu(metric):
    rows = [line.split("\t") for line in BIBLE.read_text(encoding="utf-8").splitlines()[1:201]]
    references = [spanish for _, _, spanish in rows]
    predictions = [" ".join(reversed(spanish.split())) for spanish in references]  # the right words, wrong order
    result = metric.compute(predictions=predictions, references=references)
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [references]).score)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(predictions, [references]).score)
    assert result["bleu"] < 20 < result["chrf"]  # word order matters to BLEU's n-grams, hardly to character n-grams
    assert metric.compute(predictions=references, references=references)["bleu"] == pytest.approx(100.0)
