"""Model cards: the README.md every saved checkpoint carries (`hf_attn_zoo.models.cards_zoo`, which travels with
the checkpoint's code), re-exported here for the package's callers."""

from .models.cards_zoo import GENERIC_CARD_MARK, card_metadata, model_card, write_card

__all__ = ["GENERIC_CARD_MARK", "card_metadata", "model_card", "write_card"]
