"""The translation board's claims: each claim of the notes and the papers (attention in RNNs, the Transformer
against the RNN, GQA/MQA, additive cross-attention, efficient encoders, GQA uptraining) checked on the board's rows
(board.json), with the numbers behind its verdict. "A beats B" only where the seeds' ranges do not overlap
(`compare_seeds`); "within noise" otherwise."""

import statistics

from experiments.common import compare_seeds, figure
from experiments.translation.cells import TranslationSetup, bucket_names, uptrain_config

LABELS = {
    ("rnn", "none"): "RNN, no attention",
    ("rnn", "bahdanau"): "RNN + Bahdanau",
    ("rnn", "luong"): "RNN + Luong",
    ("transformer", "mha"): "Transformer MHA",
    ("transformer", "gqa"): "Transformer GQA",
    ("transformer", "mqa"): "Transformer MQA",
    ("transformer", "additive"): "Transformer, additive cross",
    ("native", "marian"): "MarianMTModel (transformers')",
    ("parent", "mha"): "MHA parent",
}


VERDICT = {1: "holds", -1: "does not hold at this scale", 0: "within noise"}


def label(key: tuple[str, str]) -> str:
    return LABELS.get(key, f"{key[1]} encoder-decoder" if key[0] == "encoder" else f"{key[0]} {key[1]}")


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Finished rows by (family, configuration), in the board's order."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if "error" not in row:
            grouped.setdefault((row["family"], row["config"]), []).append(row)
    return grouped


def values(grouped: dict, key: tuple[str, str], metric: str = "bleu") -> list[float]:
    return [row[metric] for row in grouped.get(key, []) if metric in row]


def spread_text(numbers: list[float], digits: int = 2) -> str:
    """Mean ± standard deviation and the seeds' range."""
    if len(numbers) < 2:
        return figure(numbers, digits) + " (one run)"
    return f"{figure(numbers, digits)} [{min(numbers):.{digits}f} to {max(numbers):.{digits}f}]"


def show(grouped: dict, key: tuple[str, str], metric: str = "bleu", digits: int = 2) -> str:
    return f"{label(key)} {spread_text(values(grouped, key, metric), digits)}"


def missing(grouped: dict, *keys: tuple[str, str]) -> str | None:
    absent = [label(k) for k in keys if k not in grouped]
    return f"not measured (no finished cell of {', '.join(absent)})" if absent else None


def higher(grouped: dict, a: tuple[str, str], b: tuple[str, str], metric: str = "bleu", digits: int = 2) -> str:
    """Whether `a` scores above `b` beyond noise (every seed of a above every seed of b), with the numbers."""
    verdict = VERDICT[compare_seeds(values(grouped, a, metric), values(grouped, b, metric))]
    text = f"{verdict}: {show(grouped, a, metric, digits)} against {show(grouped, b, metric, digits)}"
    return text + (lower_perplexity(grouped, a, b) if metric == "bleu" else "")


def lower_perplexity(grouped: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    """The same comparison on the test references' perplexity (lower is better), which separates models that BLEU,
    near the floor at this scale, cannot; empty where the rows have none."""
    ours, theirs = values(grouped, a, "test_perplexity"), values(grouped, b, "test_perplexity")
    if not ours or not theirs:
        return ""
    verdict = VERDICT[-compare_seeds(ours, theirs)]
    return (
        f"; on test perplexity {verdict}: {label(a)} {spread_text(ours, 1)} against {label(b)} "
        f"{spread_text(theirs, 1)}"
    )


def bucket_bleu(rows: list[dict], bucket: str) -> list[float]:
    return [row["bleu_by_length"][bucket]["bleu"] for row in rows]


def length_gap(grouped: dict, setup: TranslationSetup) -> str:
    """The attention RNN's BLEU minus the plain RNN's, seed by seed, in the shortest and the longest bucket."""
    attended, plain = ("rnn", "bahdanau"), ("rnn", "none")
    absent = missing(grouped, attended, plain)
    if absent:
        return absent
    names = bucket_names(setup.buckets)
    by_seed = {row["seed"]: row for row in grouped[plain]}
    pairs = [(row, by_seed[row["seed"]]) for row in grouped[attended] if row["seed"] in by_seed]
    gaps = {
        name: [a["bleu_by_length"][name]["bleu"] - b["bleu_by_length"][name]["bleu"] for a, b in pairs]
        for name in names
    }
    short, long = names[0], names[-1]
    verdict = VERDICT[compare_seeds(gaps[long], gaps[short])]
    per_bucket = "; ".join(f"{name} tokens {spread_text(gaps[name])}" for name in names)
    return f"{verdict}: BLEU gap (Bahdanau - none) by source length, per seed: {per_bucket}"


def matches(grouped: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    """A claim that `a` is as good as `b`: holds unless b is above a beyond noise."""
    relation = compare_seeds(values(grouped, a), values(grouped, b))
    verdict = "does not hold at this scale" if relation < 0 else "holds"
    if relation == 0:
        verdict += " (within noise)"
    elif relation > 0:
        verdict += f" ({label(a)} above, beyond noise)"
    return f"{verdict}: {show(grouped, a)} against {show(grouped, b)}{lower_perplexity(grouped, a, b)}"


def close_to(grouped: dict, a: tuple[str, str], b: tuple[str, str]) -> str:
    """Close: a mean BLEU at least 90% of b's; further off, overlapping seeds cannot tell, apart ones say no."""
    mean_a, mean_b = statistics.fmean(values(grouped, a)), statistics.fmean(values(grouped, b))
    ratio = mean_a / mean_b if mean_b else float("nan")
    if ratio >= 0.9:
        verdict = "holds"
    elif compare_seeds(values(grouped, a), values(grouped, b)) == 0:
        verdict = "within noise"
    else:
        verdict = "does not hold at this scale"
    return f"{verdict}: {show(grouped, a)}, {ratio:.0%} of {show(grouped, b)}{lower_perplexity(grouped, a, b)}"


def cache_of(grouped: dict, key: tuple[str, str]) -> float:
    return grouped[key][0]["cache_bytes_per_source_token"]


def up(target: str, method: str, alpha: float) -> tuple[str, str]:
    return "uptrain", uptrain_config(target, method, alpha)


METRIC_NAMES = {"bleu": "BLEU", "test_perplexity": "test perplexity"}


def better(metric: str) -> int:
    """The sign of `compare_seeds(a, b)` when a is the better: BLEU higher, perplexity lower."""
    return 1 if metric == "bleu" else -1


def digits_of(metric: str) -> int:
    return 2 if metric == "bleu" else 1


def mean_against_others(grouped: dict, target: str, alpha: float, metric: str) -> str:
    """Whether mean pooling is no worse than any other conversion beyond noise, at one alpha and metric."""
    mean = up(target, "mean", alpha)
    # the conversions the board holds rows of, not the ones this run was asked for: a run of a subset of the cells
    # (`--uptrain_methods []`, one process per core) writes the same verdicts as the others
    methods = sorted({config.split("-")[1] for family, config in grouped if family == "uptrain"} - {"mean"})
    others = [up(target, m, alpha) for m in methods if "+" not in m and up(target, m, alpha) in grouped]  # no repairs
    if mean not in grouped or not others or not values(grouped, mean, metric):
        return ""
    digits = digits_of(metric)
    relations = {
        o: better(metric) * compare_seeds(values(grouped, mean, metric), values(grouped, o, metric)) for o in others
    }
    verdict = "does not hold" if any(r < 0 for r in relations.values()) else "holds"
    if all(r == 0 for r in relations.values()):
        verdict += " (within noise)"
    text = ", ".join(f"{o[1].split('-')[1]} {spread_text(values(grouped, o, metric), digits)}" for o in others)
    return (
        f"{target.upper()} alpha {alpha:g} {METRIC_NAMES[metric]}: {verdict}: mean "
        f"{spread_text(values(grouped, mean, metric), digits)} against {text}"
    )


def recovery(grouped: dict, target: str, alpha: float, metric: str) -> str:
    """The mean-pooled conversion before and after uptraining, against the parent, and the share regained."""
    parent, before, after = ("parent", "mha"), up(target, "mean", 0.0), up(target, "mean", alpha)
    if any(not values(grouped, k, metric) for k in (parent, before, after)):
        return ""
    digits, sign = digits_of(metric), better(metric)
    relation = sign * compare_seeds(values(grouped, after, metric), values(grouped, before, metric))
    mean = {k: statistics.fmean(values(grouped, k, metric)) for k in (parent, before, after)}
    lost, regained = sign * (mean[parent] - mean[before]), sign * (mean[after] - mean[before])
    share = f", {regained / lost:.0%} of the {lost:.{digits}f} lost regained" if lost > 0 else ""
    return (
        f"{target.upper()} {METRIC_NAMES[metric]}: {VERDICT[relation]}: alpha {alpha:g} "
        f"{spread_text(values(grouped, after, metric), digits)} against alpha 0 "
        f"{spread_text(values(grouped, before, metric), digits)}, parent "
        f"{spread_text(values(grouped, parent, metric), digits)}{share}"
    )


def uptraining_claims(grouped: dict, setup: TranslationSetup) -> list[tuple[str, str]]:
    parent = ("parent", "mha")
    alpha = max(setup.alphas)
    metrics = ("bleu", "test_perplexity")
    out = []
    # Fig. 5: mean pooling against the other conversions, as converted and after uptraining
    lines = [
        mean_against_others(grouped, target, a, metric)
        for target in ("gqa", "mqa")
        for a in sorted(setup.alphas)
        for metric in metrics
    ]
    out.append(
        (
            "Mean pooling converts best (Ainslie et al. 2023, Fig. 5: mean > first > random), here against the "
            "calibrated conversions, as converted (alpha 0, one run each) and after uptraining",
            "; ".join(line for line in lines if line) or "not measured",
        )
    )
    # Fig. 4: uptraining recovers what the conversion lost
    lines = [recovery(grouped, target, alpha, metric) for target in ("gqa", "mqa") for metric in metrics]
    out.append(
        (
            f"Uptraining on {alpha:g} of the parent's steps recovers the quality the mean-pooled conversion lost "
            "(Fig. 4: MQA/GQA at alpha 0 well below, most of it back by 0.05)",
            "; ".join(line for line in lines if line) or "not measured",
        )
    )
    # Table 1: uptrained GQA close to the MHA parent, MQA further
    gqa, mqa = up("gqa", "mean", alpha), up("mqa", "mean", alpha)
    absent = missing(grouped, parent, gqa, mqa)
    if absent is None:
        parts = []
        for metric in metrics:
            if any(not values(grouped, k, metric) for k in (parent, gqa, mqa)):
                continue
            digits, sign = digits_of(metric), better(metric)
            means = [sign * statistics.fmean(values(grouped, k, metric)) for k in (parent, gqa, mqa)]
            order = "holds" if means[0] >= means[1] >= means[2] else "does not hold at this scale"
            relation = sign * compare_seeds(values(grouped, gqa, metric), values(grouped, parent, metric))
            where = {-1: "worse", 0: "within noise", 1: "better"}[relation]
            parts.append(
                f"{METRIC_NAMES[metric]}: {order} (order of the means): parent "
                f"{spread_text(values(grouped, parent, metric), digits)}, GQA-{setup.gqa_key_value_heads} uptrained "
                f"{spread_text(values(grouped, gqa, metric), digits)}, MQA uptrained "
                f"{spread_text(values(grouped, mqa, metric), digits)}; uptrained GQA against the parent (the "
                f"uptraining seeds' range against one parent): {where}"
            )
        absent = "; ".join(parts)
    out.append(
        (
            "Uptrained GQA comes close to the MHA parent and MQA falls further (Table 1, T5-XXL: MHA 47.2, GQA-8 "
            "47.1, MQA 46.6 average)",
            absent,
        )
    )
    lines = []
    for target in ("gqa", "mqa"):
        scratch, uptrained = ("transformer", target), up(target, "mean", alpha)
        for metric in metrics:
            if values(grouped, scratch, metric) and values(grouped, uptrained, metric):
                digits, sign = digits_of(metric), better(metric)
                relation = sign * compare_seeds(values(grouped, uptrained, metric), values(grouped, scratch, metric))
                lines.append(
                    f"{target.upper()} {METRIC_NAMES[metric]}: {VERDICT[relation]}: uptrained "
                    f"{spread_text(values(grouped, uptrained, metric), digits)} against from scratch "
                    f"{spread_text(values(grouped, scratch, metric), digits)}"
                )
    out.append(
        (
            f"Uptraining beats training GQA/MQA from scratch (the paper's motivation; compute here: parent "
            f"{setup.parent_factor:g} budgets + {alpha:g} of them, against 1 budget for the scratch cells)",
            "; ".join(lines) or "not measured",
        )
    )
    return out


def claims(rows: list[dict], setup: TranslationSetup) -> list[tuple[str, str]]:
    """(claim, verdict with the numbers) for each claim of the notes the board checks: the RNN, Transformer and
    GQA/MQA claims always ("not measured" until their cells finish), those of the optional families (the native
    control, additive cross-attention, the efficient encoders, the uptraining) where the rows hold their cells, so
    that a board run on a subset of them (`--encoders []`) lists what it measures and the verdicts are a function
    of board.json alone."""
    grouped = groups(rows)
    present = {(row["family"], row["config"]) for row in rows}
    none, bahdanau, luong = ("rnn", "none"), ("rnn", "bahdanau"), ("rnn", "luong")
    mha, gqa, mqa, additive = (("transformer", k) for k in ("mha", "gqa", "mqa", "additive"))
    out = [
        (
            "Attention beats the same RNN without it (Bahdanau et al. 2015), greedy test BLEU",
            missing(grouped, bahdanau, none) or higher(grouped, bahdanau, none),
        ),
        (
            "Luong's attention beats the same RNN without it (Luong et al. 2015)",
            missing(grouped, luong, none) or higher(grouped, luong, none),
        ),
        (
            "The gain from attention grows with source length (Bahdanau et al. 2015, Fig. 2): the gap in the longest "
            "bucket above the gap in the shortest",
            length_gap(grouped, setup),
        ),
        (
            "The Transformer beats the RNN with attention at the same parameters (Vaswani et al. 2017)",
            missing(grouped, mha, bahdanau) or higher(grouped, mha, bahdanau),
        ),
    ]
    if ("native", "marian") in present:
        out.append(
            (
                "The zoo's MHA encoder-decoder reaches at least the BLEU of transformers' own MarianMTModel of the "
                "same parameters at equal steps (the native control)",
                missing(grouped, mha, ("native", "marian")) or matches(grouped, mha, ("native", "marian")),
            )
        )
    out.append(
        (
            "The Transformer trains faster per token than the RNN (parallel over the sequence), training tokens/s",
            missing(grouped, mha, bahdanau, none)
            or "; ".join(higher(grouped, mha, rnn, "tokens_per_second", 0) for rnn in (bahdanau, none)),
        )
    )
    if missing(grouped, mha, gqa) is None:
        ratio = cache_of(grouped, mha) / cache_of(grouped, gqa)
        gqa_text = (
            f"{matches(grouped, gqa, mha)}; cache {cache_of(grouped, gqa):,.0f} against "
            f"{cache_of(grouped, mha):,.0f} bytes per source token ({ratio:g}x less)"
        )
    else:
        gqa_text = missing(grouped, mha, gqa)
    out.append(
        (
            "GQA cross- and decoder self-attention match MHA's quality at a fraction of its cache "
            "(Ainslie et al. 2023)",
            gqa_text,
        )
    )
    if missing(grouped, mha, mqa) is None:
        ratio = cache_of(grouped, mha) / cache_of(grouped, mqa)
        mqa_text = (
            f"{higher(grouped, mha, mqa)}; cache {cache_of(grouped, mqa):,.0f} against "
            f"{cache_of(grouped, mha):,.0f} bytes per source token ({ratio:g}x less)"
        )
    else:
        mqa_text = missing(grouped, mha, mqa)
    out.append(("MQA loses quality against MHA (Shazeer 2019; Ainslie et al. 2023)", mqa_text))
    if additive in present:
        out.append(
            (
                "Dot-product cross-attention matches additive (Vaswani et al. 2017, 3.2.1: similar quality, faster)",
                missing(grouped, mha, additive)
                or f"{matches(grouped, mha, additive)}; decode tokens/s "
                f"{higher(grouped, mha, additive, 'decode_tokens_per_second', 0)}",
            )
        )
    encoders = [config for family, config in present if family == "encoder"]
    for variant in sorted(encoders, key=lambda v: (setup.encoders + [v]).index(v)):  # the board's order first
        key = ("encoder", variant)
        out.append(
            (
                f"An efficient encoder ({variant}) comes close to full attention in translation: a mean BLEU at "
                "least 90% of the MHA Transformer's",
                missing(grouped, key, mha) or close_to(grouped, key, mha),
            )
        )
    if any(family in ("parent", "uptrain") for family, _ in present) and setup.alphas:
        out += uptraining_claims(grouped, setup)
    if any(family == "uptrain" and "+" in config for family, config in present) and setup.alphas:
        out.append(repair_claim(grouped, max(setup.alphas)))
    return out


def repair_claim(grouped: dict, alpha: float) -> tuple[str, str]:
    """Attention transfer alone, and transfer then distillation, against cross-entropy uptraining of the same
    mean-pooled conversion on alpha of the parent's tokens."""
    lines = []
    for target in ("gqa", "mqa"):
        ce = up(target, "mean", alpha)
        for repair in ("transfer", "transfer_distill"):
            other = ("uptrain", uptrain_config(target, "mean", alpha, repair))
            for metric in ("bleu", "test_perplexity"):
                ours, theirs = values(grouped, other, metric), values(grouped, ce, metric)
                if ours and theirs:
                    digits = digits_of(metric)
                    relation = better(metric) * compare_seeds(ours, theirs)
                    lines.append(
                        f"{target.upper()} {repair.replace('_', ' + ')} {METRIC_NAMES[metric]}: {VERDICT[relation]}: "
                        f"{spread_text(ours, digits)} against cross-entropy {spread_text(theirs, digits)}"
                    )
    return (
        f"Attention transfer, and transfer then distillation, repair the mean-pooled conversion more than "
        f"cross-entropy uptraining on the same {alpha:g} of the parent's tokens (LoLCATs, Zhang et al. 2024)",
        "; ".join(lines) or "not measured",
    )


def verdict_block(rows: list[dict], setup: TranslationSetup) -> str:
    return "\n".join(f"- **{claim}**: {verdict}." for claim, verdict in claims(rows, setup))
