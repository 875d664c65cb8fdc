"""Batches by token count over pairs of similar length, as NMT toolkits batch (fairseq's `--max-tokens`, JoeyNMT's
`batch_type: token`): a batch holds as many pairs as fit `batch_tokens` padded tokens, so short pairs come many to a
batch and long ones few, and pairs of similar length share a batch, so little of it is padding.

`TokenBatchSampler` is a `torch.utils.data.Sampler` of index lists: every epoch the pairs are shuffled by the seed,
sorted by length within buckets of `bucket_batches` batches (so the order still varies from epoch to epoch), cut into
batches, and the batches shuffled. Under several processes each takes every `num_replicas`-th batch.
"""

import math
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler


class TokenBatchSampler(Sampler[list[int]]):
    """Batches of pair indices whose padded size, `count x (longest source + longest target)`, stays within
    `batch_tokens`; a pair longer than the budget alone is a batch of one.

    Args:
        source_lengths, target_lengths: tokens of each pair's source and target.
        batch_tokens: padded tokens (source + target) a batch may hold.
        seed: the shuffling of each epoch is `seed + epoch` (`set_epoch`), the same on every process.
        bucket_batches: pairs are sorted by length within runs of about this many batches' worth.
        num_replicas, rank: this process's share of the batches (every `num_replicas`-th, from `rank`).
    """

    def __init__(
        self,
        source_lengths: Sequence[int],
        target_lengths: Sequence[int],
        batch_tokens: int,
        seed: int = 0,
        bucket_batches: int = 100,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if batch_tokens <= 0:
            raise ValueError(f"batch_tokens={batch_tokens} must be a positive number of tokens.")
        self.source_lengths, self.target_lengths = list(source_lengths), list(target_lengths)
        self.batch_tokens, self.seed, self.bucket_batches = batch_tokens, seed, bucket_batches
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0
        self._batches = self._make_batches()

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer before each epoch: the next epoch's order."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._batches = self._make_batches()

    def _make_batches(self) -> list[list[int]]:
        generator = random.Random(self.seed + self.epoch)
        order = list(range(len(self.source_lengths)))
        generator.shuffle(order)
        pair_tokens = sum(self.source_lengths) + sum(self.target_lengths)
        mean = pair_tokens / max(len(order), 1)
        bucket = max(1, round(self.bucket_batches * self.batch_tokens / max(mean, 1)))  # pairs per bucket
        batches, length = [], lambda i: (self.source_lengths[i], self.target_lengths[i])
        for start in range(0, len(order), bucket):
            batches += self._cut(sorted(order[start : start + bucket], key=length))
        generator.shuffle(batches)
        # every process the same number of batches: the first ones again where the count does not divide
        whole = math.ceil(len(batches) / self.num_replicas) * self.num_replicas
        batches += batches[: whole - len(batches)]
        return batches[self.rank :: self.num_replicas]

    def _cut(self, indices: list[int]) -> list[list[int]]:
        batches, batch, longest_source, longest_target = [], [], 0, 0
        for index in indices:
            source = max(longest_source, self.source_lengths[index])
            target = max(longest_target, self.target_lengths[index])
            if batch and (len(batch) + 1) * (source + target) > self.batch_tokens:
                batches.append(batch)
                batch, source, target = [], self.source_lengths[index], self.target_lengths[index]
            batch.append(index)
            longest_source, longest_target = source, target
        if batch:
            batches.append(batch)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def padding_fraction(self) -> float:
        """The share of this epoch's padded batch tokens (source and target sides each padded to its longest) that
        is padding."""
        real = padded = 0
        for batch in self._batches:
            sources = [self.source_lengths[i] for i in batch]
            targets = [self.target_lengths[i] for i in batch]
            real += sum(sources) + sum(targets)
            padded += len(batch) * (max(sources) + max(targets))
        return 1 - real / max(padded, 1)

    def mean_batch_tokens(self) -> float:
        """Real (unpadded) tokens of a batch, on average over the epoch."""
        total = sum(self.source_lengths[i] + self.target_lengths[i] for batch in self._batches for i in batch)
        return total / max(len(self._batches), 1)
