"""Perplexity, scored the same honest way for every causal LM: corpus-level, token-weighted, sliding windows.

- Corpus level: perplexity = exp(total NLL / total predicted tokens) over all texts, never a mean of per-text
  perplexities.
- Sliding windows (`max_length`, `stride`): a text longer than `max_length` tokens is cut into windows starting every
  `stride` tokens; each window sees up to `max_length` tokens of context and scores only the tokens no earlier
  window scored, so every token is counted exactly once (stride = max_length gives disjoint windows).
- A BOS token is prepended when the tokenizer has one, so the first token of a text is predicted from BOS; without
  one, the first token has no context and is not scored.
- Bits per byte and word perplexity as lm-evaluation-harness defines them: bits_per_byte = total NLL / ln 2 / UTF-8
  bytes; word_perplexity = exp(total NLL / words), words counted with `re.split(r"\\s+", text)`.
- Batching does not change the numbers: windows of different lengths are left-padded with `position_ids` counted
  over the real tokens, padding is never scored, and log-probabilities and sums are computed in float64.
"""

import math
import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm


@dataclass
class PerplexityResult:
    perplexity: float
    bits_per_byte: float
    word_perplexity: float
    nll: float  # total negative log-likelihood in nats
    tokens: int  # predicted tokens
    bytes: int
    words: int
    max_length: int
    stride: int

    def as_dict(self) -> dict:
        return asdict(self)


def plan_windows(ids: list[int], max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) of every window over `ids`: the window is ids[begin:end], and positions
    from `first scored` on are scored (position 0 of a text never is: nothing predicts it)."""
    if not 0 < stride <= max_length:
        raise ValueError(
            f"stride must be in [1, max_length={max_length}], got {stride}: a larger stride skips tokens."
        )
    windows, begin, scored_until = [], 0, 1
    while True:
        end = min(begin + max_length, len(ids))
        if end > scored_until:
            windows.append((begin, end, scored_until))
        scored_until = end
        if end >= len(ids):
            return windows
        begin += stride


# Position types that extrapolate by design: ALiBi's linear bias and no positions at all hold for any distance, so
# windows longer than the model was trained on are the experiment ALiBi was made for (Press et al. 2022). Others
# (RoPE, sinusoidal, learned) are refused beyond `max_position_embeddings`.
EXTRAPOLATING_POSITIONS = ("alibi", "none")


def position_limit(config, tokenizer=None) -> int | None:
    """The longest window the model is built for: its `max_position_embeddings` (n_positions ...), else the
    tokenizer's `model_max_length` when it is a real limit; None where neither says."""
    for candidate in (getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)):
        if candidate and candidate < 1_000_000:
            return int(candidate)
    return None


def window_lengths(
    config, max_length: int | None, stride: int | None, tokenizer=None, notice: bool = True
) -> tuple[int, int]:
    """(max_length, stride) of the windows for a model of `config`: its limit and disjoint windows by default. 0 or a
    negative number, or a window longer than the model's positions, is refused naming the limit (`UserError`), except
    for positions that extrapolate by design (`EXTRAPOLATING_POSITIONS`), which are scored with a printed notice."""
    from ..errors import UserError

    for name, value in (("max_length", max_length), ("stride", stride)):
        if value is not None and value < 1:
            raise UserError(f"{name}={value} must be a positive number of tokens; leave it unset for the default")
    limit = position_limit(config, tokenizer)
    if max_length is None:
        max_length = limit or 2048
    elif limit is not None and max_length > limit:
        table = getattr(config, "position_table", "")  # weights sized by the positions bind whatever the positions
        if table:
            raise UserError(
                f"max_length={max_length} is longer than the model's {limit} positions: {table} has one entry per "
                f"position (max_position_embeddings) whatever its position type; use max_length <= {limit}, or a "
                f"model built with a larger max_position_embeddings"
            )
        positions = getattr(config, "position_embedding_type", None)
        if positions not in EXTRAPOLATING_POSITIONS:
            raise UserError(
                f"max_length={max_length} is longer than the model's {limit} positions (max_position_embeddings; "
                f"its positions are {positions or 'not known to extrapolate'}): use max_length <= {limit}, or a "
                f"model with positions that extrapolate ({', '.join(EXTRAPOLATING_POSITIONS)})"
            )
        if notice:
            print(
                f"note: windows of {max_length} tokens, beyond the model's max_position_embeddings={limit}; its "
                f"{positions} positions extrapolate by design",
                file=sys.stderr,
            )
    stride = max_length if stride is None else stride
    if stride > max_length:
        raise UserError(
            f"stride={stride} is larger than max_length={max_length}: tokens between windows would be skipped"
        )
    return max_length, stride


@torch.no_grad()
def score_texts(
    model,
    tokenizer,
    texts: Iterable[str],
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    add_bos: bool | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Score `texts` with a causal LM (any `AutoModelForCausalLM`, zoo or not)."""
    texts = list(texts)
    if not texts:
        raise ValueError("no texts to score")
    max_length, stride = window_lengths(model.config, max_length, stride, tokenizer)
    add_bos = tokenizer.bos_token_id is not None if add_bos is None else add_bos
    windows = []  # (token ids of the window, index of its first scored token)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if add_bos:
            ids = [tokenizer.bos_token_id] + ids
        windows += [(ids[begin:end], first - begin) for begin, end, first in plan_windows(ids, max_length, stride)]
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total_nll, total_tokens = 0.0, 0
    was_training = model.training
    model.eval()
    batches = range(0, len(windows), batch_size)
    for start in tqdm(batches, desc="scoring windows", unit="batch", disable=not progress):
        batch = windows[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        scored = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, (ids, first) in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)  # left padding
            attention_mask[row, width - len(ids) :] = 1
            scored[row, width - len(ids) + first :] = True
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=False,
        ).logits
        # token t is predicted by the logits at t - 1; only the scored rows, in float64, a few at a time
        mask = scored[:, 1:].to(device)
        rows, targets = logits[:, :-1][mask], input_ids[:, 1:].to(device)[mask]  # (N, vocab), (N,)
        for start in range(0, len(rows), 256):
            chunk = rows[start : start + 256].double()
            total_nll += F.cross_entropy(chunk, targets[start : start + 256], reduction="sum").item()
        total_tokens += len(targets)
    model.train(was_training)
    if total_tokens == 0:
        raise ValueError("nothing to score: every text is shorter than two tokens")
    total_bytes = sum(len(text.encode("utf-8")) for text in texts)
    total_words = sum(len(re.split(r"\s+", text)) for text in texts)
    return PerplexityResult(
        perplexity=math.exp(total_nll / total_tokens),
        bits_per_byte=total_nll / math.log(2) / total_bytes,
        word_perplexity=math.exp(total_nll / total_words),
        nll=total_nll,
        tokens=total_tokens,
        bytes=total_bytes,
        words=total_words,
        max_length=max_length,
        stride=stride,
    )


def load_for_scoring(
    model_name_or_path: str, trust_remote_code: bool = False, gguf_file: str | None = None, dtype=None
):
    """(model, tokenizer) from a checkpoint folder or Hub name, through the Auto classes; a folder that is missing,
    or lacks weights or a tokenizer, is refused in one line naming what is missing."""
    from ..loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(
        model_name_or_path, trust_remote_code=trust_remote_code, gguf_file=gguf_file, dtype=dtype
    )
    return model.eval(), tokenizer
