"""FLOPs per token: each variant's declared sequence-mixing FLOPs (`ZooAttention.mixing_flops_per_token`) and the
training FLOPs per token built on them (`hf_attn_zoo.train.build.training_flops_per_token`)."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.train.build import non_embedding_parameters, training_flops_per_token

from conftest import tiny_config

LENGTH = 32  # tokens of the forward the counter watches; every tiny config has max_position_embeddings 64

# What makes each kernel compute exactly the declared work at LENGTH, so the counter can check it: the chunked kernels
# skip the keys after a chunk's last query (about half of them, causally), so one chunk holds every query; the
# sliding window's banded kernel computes blocks of at least 64 x (64 + w) scores, more than its w keys, so the window
# covers the sequence and the dense path runs; AFT-local's window covers it too (its dense path, the full sum).
EXACT_AT_LENGTH = {
    "sliding_window": dict(sliding_window=LENGTH),
    "topk": dict(query_chunk_size=LENGTH),
    "additive": dict(query_chunk_size=LENGTH),
    "aft_local": dict(aft_window=LENGTH),
}


def test_mha_gives_the_palm_formula_exactly():
    config = tiny_config("mha")
    model = VARIANTS["mha"].causal_lm_class(config)
    layers, heads, head_dim = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    palm = 6 * non_embedding_parameters(model) + 12 * layers * heads * head_dim * LENGTH
    assert training_flops_per_token(model, LENGTH) == palm
    # forward: 2·2·H·d_h·T per layer (scores and weighted values)
    attention = VARIANTS["mha"].attention_class
    assert attention.mixing_flops_per_token(config, LENGTH) == 4 * heads * head_dim * LENGTH


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_declares_positive_finite_mixing_flops(name):
    config = tiny_config(name)
    for length in (1, LENGTH, config.max_position_embeddings):
        flops = VARIANTS[name].attention_class.mixing_flops_per_token(config, length)
        assert flops > 0 and math.isfinite(flops), (name, length, flops)
    model = VARIANTS[name].causal_lm_class(config)
    assert training_flops_per_token(model, LENGTH) > 6 * non_embedding_parameters(model)


def counted_mixing_flops(name: str) -> tuple[float, float]:
    """(FLOPs per layer and token FlopCounterMode sees outside the Linear layers in an eager forward of LENGTH
    tokens, the variant's declared mixing FLOPs at LENGTH)."""
    config = tiny_config(name, **EXACT_AT_LENGTH.get(name, {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    batch = 2
    input_ids = torch.randint(2, config.vocab_size, (batch, LENGTH))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids)
    # a Linear layer's matmul is exactly 2·in·out per token (its bias add is not counted): the rest is the mixing
    linear = sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    mixing = (counter.get_total_flops() - batch * LENGTH * linear) / (batch * LENGTH * config.num_hidden_layers)
    return mixing, VARIANTS[name].attention_class.mixing_flops_per_token(config, LENGTH)


# The counter sees matrix products only (mm, bmm, addmm, sdpa), never elementwise work: where a variant's declared
# FLOPs include elementwise work, that part is subtracted before comparing.
UNSEEN_ELEMENTWISE = {
    # q + k and tanh over additive_dim channels for every (query head, key) pair
    "additive": lambda config: 2 * config.num_attention_heads * config.additive_dim * LENGTH,
    # AFT-simple is running sums only: nothing the counter sees
    "aft_simple": lambda config: 5 * config.hidden_size,
    # Mamba: the counter sees the depthwise convolution (2·D·k) and the read C_t h_t (a batched product, 2·D·N); the
    # rest of the scan, the skip and the gate are elementwise
    "mamba": lambda config: (
        VARIANTS["mamba"].attention_class.mixing_flops_per_token(config, LENGTH)
        - 2 * config.intermediate_size * (config.conv_kernel + config.state_size)
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_declared_mixing_flops_match_what_the_forward_computes(name):
    """Against torch's FlopCounterMode on an eager forward, within 1% (measured: equal): with the configs of
    `EXACT_AT_LENGTH` the declared matrix-product work is exactly what the kernels run."""
    counted, declared = counted_mixing_flops(name)
    config = tiny_config(name, **EXACT_AT_LENGTH.get(name, {}))
    unseen = UNSEEN_ELEMENTWISE.get(name, lambda config: 0)(config)
    if name == "aft_simple":
        assert counted == 0 and declared == unseen
        return
    assert counted == pytest.approx(declared - unseen, rel=0.01), (name, counted, declared, unseen)
