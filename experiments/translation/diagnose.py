"""Does a translator read its source? The zoo's MHA encoder-decoder beside transformers' own `MarianMTModel` of the
same sizes, trained by one loop on the same Bible pairs (issue 50: the zoo's Transformer wrote the same few
sentences whatever the input).

One run trains one model (`--model zoo` or `marian`; `--config` adds zoo config fields, the ablations) with Adam,
linear warm-up then cosine decay, gradients clipped at 1, on batches of `--batch_size` pairs of similar length
(`batches`), and writes one JSON row to `--output`:
- every `--eval_every` steps and at the end, the validation references' perplexity with their own sources and
  with the sources shuffled among the pairs (`shuffle_ratio`: a model that reads its source loses much; one that
  does not, nothing);
- greedy translations of `--decode` validation verses: BLEU, chrF, and how many of them are distinct;
- at initialisation and after training, on one fixed batch: the RMS of the encoder's output, of the decoder's
  residual stream after each layer, of each layer's self- and cross-attention output (what it adds to the stream),
  the gradient norms of the cross-attention's and the self-attention's parameters, and the mean entropy of the
  cross-attention weights over the real source tokens as a fraction of the uniform distribution's (1: no alignment).

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/translation/diagnose.py --model marian --steps 600 \
        --max_length 32
    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/translation/diagnose.py --model zoo --steps 600 \
        --max_length 32 \
        --config '{"position_embedding_type": "sinusoidal"}'

docs/translation.md ("Does the Transformer read its source?") reports the runs.
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoTokenizer, MarianConfig, MarianMTModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.translation.board import BOOK, bleu_chrf  # noqa: E402
from hf_attn_zoo.data import train_byte_level_bpe  # noqa: E402
from hf_attn_zoo.models import SEQ2SEQ  # noqa: E402
from hf_attn_zoo.pairs import seq2seq_tokenizer  # noqa: E402
from hf_attn_zoo.train.trainer import drop_words  # noqa: E402


def batches(pairs: list[tuple[list[int], list[int]]], size: int, seed: int) -> Iterator[list]:
    """Endless batches of `size` pairs: each epoch shuffled by `seed`, then sorted by length within chunks of 50
    batches (little padding) and the batches shuffled again."""
    epoch = 0
    while True:
        order = list(pairs)
        rng = random.Random(seed * 1000 + epoch)
        rng.shuffle(order)
        chunk = 50 * size
        epoch_batches = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start : start + chunk], key=lambda pair: len(pair[0]) + len(pair[1]))
            epoch_batches += [part[i : i + size] for i in range(0, len(part), size)]
        rng.shuffle(epoch_batches)
        yield from epoch_batches
        epoch += 1


def collate(pairs: list, pad: int) -> dict[str, torch.Tensor]:
    """Sources padded on the right with `pad` (and their mask), labels with -100."""
    width_source = max(len(source) for source, _ in pairs)
    width_target = max(len(target) for _, target in pairs)
    input_ids = torch.full((len(pairs), width_source), pad)  # (B, S)
    labels = torch.full((len(pairs), width_target), -100)  # (B, T)
    for row, (source, target) in enumerate(pairs):
        input_ids[row, : len(source)] = torch.tensor(source)
        labels[row, : len(target)] = torch.tensor(target)
    mask = torch.zeros_like(input_ids)
    for row, (source, _) in enumerate(pairs):
        mask[row, : len(source)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def load_pairs(args) -> tuple:
    """(tokenizer, training pairs as token ids, validation pairs as text): books as the issue's recipe splits them
    (validation Mark, test Luke and Acts, never read here), pairs of at most `--max_length` tokens a side."""
    train, validation = [], []
    with open(Path(args.data_dir) / "pairs.tsv", encoding="utf-8") as handle:
        next(handle)
        for line in handle:
            ref, english, spanish = line.rstrip("\n").split("\t")
            book = BOOK.match(ref).group(1)
            if book in ("Luke", "Acts"):
                continue
            (validation if book == "Mark" else train).append((english, spanish))
    folder = Path(args.work_dir) / f"tokenizer-{args.vocab_size}"
    if not folder.is_dir():
        train_byte_level_bpe([text for pair in train for text in pair], args.vocab_size).save_pretrained(folder)
    tokenizer = seq2seq_tokenizer(AutoTokenizer.from_pretrained(folder))

    def fits(source: list[int], target: list[int]) -> bool:
        return len(source) <= args.max_length and len(target) <= args.max_length

    encoded = [(tokenizer(en)["input_ids"], tokenizer(es)["input_ids"]) for en, es in train]
    encoded = [pair for pair in encoded if fits(*pair)]
    fitting = [pair for pair in validation if fits(tokenizer(pair[0])["input_ids"], tokenizer(pair[1])["input_ids"])]
    validation = random.Random(1).sample(fitting, min(args.validation_pairs, len(fitting)))
    return tokenizer, encoded, validation


def build(args, tokenizer) -> torch.nn.Module:
    tokens = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.bos_token_id,
    }
    torch.manual_seed(args.seed)
    if args.model == "zoo":
        fields = {
            **tokens,
            "hidden_size": args.hidden_size,
            "num_hidden_layers": args.layers,
            "encoder_layers": args.layers,
            "decoder_layers": args.layers,
            "num_attention_heads": args.heads,
            "max_position_embeddings": args.max_length + 1,
            "tie_word_embeddings": True,
            **json.loads(args.config),
        }
        model = SEQ2SEQ["mha"].build(None, attn_implementation="sdpa", **fields)
    else:
        config = MarianConfig(
            **tokens,
            d_model=args.hidden_size,
            encoder_layers=args.layers,
            decoder_layers=args.layers,
            encoder_attention_heads=args.heads,
            decoder_attention_heads=args.heads,
            encoder_ffn_dim=args.ffn,
            decoder_ffn_dim=args.ffn,
            max_position_embeddings=args.max_length + 1,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            activation_function="swish",
            scale_embedding=True,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
            **json.loads(args.config),
        )
        model = MarianMTModel(config)
        model.set_attn_implementation("sdpa")
    generation = model.generation_config
    generation.max_length = args.max_length + 1
    for name in ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(generation, name, tokens[name])
    generation.num_beams, generation.forced_eos_token_id, generation.bad_words_ids = 1, None, None
    return model


def rms(tensor: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Root mean square over the real tokens (`mask` (B, T), 1 for real) or every position."""
    squares = tensor.detach().float().pow(2).mean(-1)  # (B, T)
    if mask is not None:
        return round(math.sqrt(float((squares * mask).sum() / mask.sum())), 4)
    return round(math.sqrt(float(squares.mean())), 4)


def inspect_batch(model, batch: dict) -> dict:
    """One forward and backward on `batch` in training mode, with the scales, gradients and entropy above."""
    layers = model.model.decoder.layers
    target_mask = (batch["labels"] != -100).float()  # (B, T)
    seen: dict[str, list[float]] = {"decoder_layer": [], "self_attention": [], "cross_attention": []}
    hooks = []
    for layer in layers:
        hooks.append(
            layer.register_forward_hook(lambda m, i, o: seen["decoder_layer"].append(rms(_first(o), target_mask)))
        )
        hooks.append(
            layer.self_attn.register_forward_hook(
                lambda m, i, o: seen["self_attention"].append(rms(_first(o), target_mask))
            )
        )
        hooks.append(
            layer.encoder_attn.register_forward_hook(
                lambda m, i, o: seen["cross_attention"].append(rms(_first(o), target_mask))
            )
        )
    model.train()
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("eager")  # the weights: sdpa returns none
    output = model(**batch, output_attentions=True)
    output.loss.backward()
    for hook in hooks:
        hook.remove()
    source_mask = batch["attention_mask"].float()  # (B, S)
    entropies = []
    for weights in output.cross_attentions:  # (B, H, T, S)
        weights = weights.detach()
        entropy = -(weights.clamp_min(1e-12).log() * weights).sum(-1)  # (B, H, T)
        uniform = source_mask.sum(-1).log().view(-1, 1, 1)  # (B, 1, 1)
        relative = (entropy / uniform).mean(1)  # (B, T)
        entropies.append(round(float((relative * target_mask).sum() / target_mask.sum()), 3))

    def grad_norm(parameters) -> float:
        return round(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in parameters if p.grad is not None)), 5)

    result = {
        "loss": round(float(output.loss), 4),
        "embedding_rms": rms(model.get_input_embeddings().weight),
        "encoder_output_rms": rms(output.encoder_last_hidden_state, source_mask),
        **seen,
        "cross_attention_entropy": entropies,
        "cross_attention_grad": [grad_norm(layer.encoder_attn.parameters()) for layer in layers],
        "self_attention_grad": [grad_norm(layer.self_attn.parameters()) for layer in layers],
        "encoder_grad": grad_norm(p for n, p in model.model.encoder.named_parameters() if "embed" not in n),
    }
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("sdpa")
    return result


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def reference_perplexity(model, tokenizer, pairs: list[tuple[str, str]]) -> float:
    encoded = [(tokenizer(en)["input_ids"], tokenizer(es)["input_ids"]) for en, es in pairs]
    total, tokens = 0.0, 0
    for start in range(0, len(encoded), 50):
        batch = collate(encoded[start : start + 50], tokenizer.pad_token_id)
        count = int((batch["labels"] != -100).sum())
        total += float(model(**batch).loss) * count
        tokens += count
    return round(math.exp(total / tokens), 3)


@torch.no_grad()
def translate(model, tokenizer, sources: list[str], max_length: int) -> list[str]:
    translations = []
    tokenizer.padding_side = "right"
    for start in range(0, len(sources), 25):
        inputs = tokenizer(sources[start : start + 25], return_tensors="pt", padding=True)
        generated = model.generate(**inputs, max_new_tokens=max_length, num_beams=1, do_sample=False)
        translations += [text.strip() for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
    return translations


def source_use(model, tokenizer, validation: list[tuple[str, str]]) -> dict:
    """The references' perplexity with their own sources, with the sources shuffled among the pairs, and the ratio."""
    shuffled = [source for source, _ in validation]
    random.Random(3).shuffle(shuffled)
    true = reference_perplexity(model, tokenizer, validation)
    wrong = reference_perplexity(
        model, tokenizer, [(source, target) for source, (_, target) in zip(shuffled, validation)]
    )
    return {"perplexity": true, "perplexity_shuffled": wrong, "shuffle_ratio": round(wrong / true, 3)}


def train(model, pairs, args, tokenizer, validation) -> dict:
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.98))

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps - args.warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    stream = batches(pairs, args.batch_size, args.seed)
    model.train()
    losses, curve, start = [], [], time.perf_counter()
    for step in range(args.steps):
        batch = collate(next(stream), pad)
        if args.target_word_dropout:  # the decoder's inputs lose words, as the recipe field does (`drop_words`)
            decoder_inputs = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
            keep = decoder_inputs == pad
            keep[:, 0] = True
            batch["decoder_input_ids"] = drop_words(decoder_inputs, args.target_word_dropout, pad, keep)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {statistics.fmean(losses[-100:]):.3f}", file=sys.stderr, flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.eval()
            curve.append({"step": step + 1, **source_use(model, tokenizer, validation[:100])})
            print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
            model.train()
    model.eval()
    seconds = round(time.perf_counter() - start, 1)
    return {"train_seconds": seconds, "final_loss": round(statistics.fmean(losses[-50:]), 4), "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("zoo", "marian"), default="zoo")
    parser.add_argument("--config", default="{}", help="JSON config fields over the defaults (the ablations)")
    parser.add_argument("--label", default="", help="the row's name in the output")
    parser.add_argument(
        "--embedding_std", type=float, default=None, help="re-initialise the (shared) token embeddings at this std"
    )
    parser.add_argument(
        "--target_word_dropout", type=float, default=0.0, help="replace decoder inputs by the pad token at this rate"
    )
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--ffn", type=int, default=344, help="Marian's MLP width (the zoo's gated default is 344 at 128)"
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--validation_pairs", type=int, default=300)
    parser.add_argument("--decode", type=int, default=100)
    parser.add_argument("--eval_every", type=int, default=200, help="steps between source-use checks on 100 pairs")
    parser.add_argument("--data_dir", default=str(Path(__file__).resolve().parents[3] / "shared/data/bible_en_es"))
    parser.add_argument("--work_dir", default="/tmp/nmt-diagnose")
    parser.add_argument("--output", default="/tmp/nmt-diagnose/rows.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    tokenizer, pairs, validation = load_pairs(args)
    model = build(args, tokenizer)
    if args.embedding_std is not None:  # the ablation of the token embeddings' initial scale alone
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=args.embedding_std)
    probe = collate(random.Random(7).sample(pairs, 32), tokenizer.pad_token_id)
    row = {
        "label": args.label or args.model,
        "model": args.model,
        "config": json.loads(args.config),
        "embedding_std": args.embedding_std,
        "target_word_dropout": args.target_word_dropout,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "steps": args.steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "at_init": inspect_batch(model, probe),
    }
    row.update(train(model, pairs, args, tokenizer, validation))
    row["after"] = inspect_batch(model, probe)
    model.eval()
    row.update(source_use(model, tokenizer, validation))
    sample = validation[: args.decode]
    translations = translate(model, tokenizer, [source for source, _ in sample], args.max_length)
    row["bleu"], row["chrf"] = bleu_chrf(translations, [target for _, target in sample])
    row["distinct"] = len(set(translations))
    row["examples"] = translations[:3]
    print(json.dumps(row))
    with open(args.output, "a") as handle:
        handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
