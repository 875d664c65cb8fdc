"""Top-k attention: the selection, and k >= the visible keys as plain causal attention."""

import torch

from conftest import ATOL, left_padded_batch, tiny_model


def test_topk_at_least_the_visible_keys_is_gqa():
    gqa = tiny_model("gqa", attn_implementation="eager")
    topk = tiny_model("topk", topk=64, query_chunk_size=64)  # one chunk, every key kept
    topk.load_state_dict(gqa.state_dict())
    gqa.set_attn_implementation("eager")
    input_ids, attention_mask, rows = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(topk(input_ids).logits, gqa(input_ids).logits, atol=ATOL, rtol=0)
        a = topk(input_ids, attention_mask=attention_mask).logits
        b = gqa(input_ids, attention_mask=attention_mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(a[i, -len(row) :], b[i, -len(row) :], atol=ATOL, rtol=0)


def test_each_query_mixes_at_most_k_values():
    model = tiny_model("topk", topk=3, query_chunk_size=5)
    input_ids = torch.randint(3, 90, (2, 13))
    with torch.no_grad():
        attentions = model(input_ids, output_attentions=True).attentions
    for weights in attentions:  # (B, H, T, T)
        nonzero = (weights > 0).sum(-1)
        visible = torch.arange(1, 14).clamp(max=3)
        assert torch.equal(nonzero, visible.expand_as(nonzero))
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
