"""What every zoo translator shares with BART's layout, whichever network it runs: decoder inputs shifted from the
labels, the embedding shared by encoder and decoder (`model.shared`), and the accessors transformers' generation,
`resize_token_embeddings` and the Seq2Seq collator call on the base model and on the generation head.

Mixed into `seq2seq_zoo.py`'s Transformer encoder-decoders and `rnn.py`'s RNN translator. This module is copied next
to their checkpoints (remote code), so it imports only torch.
"""

import torch
from torch import nn


def shift_tokens_right(
    input_ids: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int | None
) -> torch.Tensor:
    """BART's decoder inputs from labels: `decoder_start_token_id`, then the labels but the last, -100 as padding."""
    if decoder_start_token_id is None:
        raise ValueError(
            "decoder_start_token_id is not set: the decoder's inputs start with it (labels are shifted right behind "
            "it); set config.decoder_start_token_id (BART uses eos, T5 and Marian pad)."
        )
    if pad_token_id is None:
        raise ValueError(
            "pad_token_id is not set: label positions ignored as -100 become padding in the decoder's inputs; set "
            "config.pad_token_id."
        )
    shifted = input_ids.new_zeros(input_ids.shape)  # (B, T)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class SharedEmbeddingModel:
    """A base encoder-decoder (`shared`, `encoder`, `decoder`, each side reading `shared` as its `embed_tokens`)."""

    shared: nn.Embedding
    encoder: nn.Module
    decoder: nn.Module

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = self.encoder.embed_tokens = self.decoder.embed_tokens = value

    def get_encoder(self) -> nn.Module:
        return self.encoder

    def get_decoder(self) -> nn.Module:
        return self.decoder


class TranslatorHead:
    """A generation head over a `SharedEmbeddingModel` (`model`) with its `lm_head`."""

    model: SharedEmbeddingModel
    lm_head: nn.Linear

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def get_encoder(self) -> nn.Module:
        return self.model.encoder

    def get_decoder(self) -> nn.Module:
        return self.model.decoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)
