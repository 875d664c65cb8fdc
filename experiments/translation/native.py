"""transformers' own `MarianMTModel` as the native control of a zoo translator recipe: a fresh Marian of the recipe's
sizes with the recipe's tokenizer, written as a checkpoint that `hf-attn-zoo train` starts from (`model.init_from`),
so that the control trains by the same recipe (data, batches, schedule, label smoothing, averaging) on the same pairs,
and `hf-attn-zoo translate-eval` scores it as it scores the zoo's model.

The sizes come from the recipe's zoo config: `d_model` its width, its encoder and decoder layers and heads, dropout
and attention dropout its `hidden_dropout` and `attention_dropout`, and the zoo's MLP width (1.5 times it when the
zoo's MLP is gated, so that Marian's two matrices hold as many weights as the gated MLP's three). The rest is
Marian's own: post-norm LayerNorm, biases, token embeddings scaled by sqrt(d_model), sinusoidal positions, a SiLU
("swish") MLP, one embedding shared by encoder, decoder and output. The tokenizer is the zoo run's
(`<run>/tokenizer`), so both models read the same token ids.

    python experiments/translation/native.py configs/train/bible_en_es_transformer.yaml \
        runs/bible_en_es_transformer/tokenizer runs/bible_en_es_marian_init
    hf-attn-zoo train configs/train/bible_en_es_marian.yaml
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, MarianConfig, MarianMTModel, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_attn_zoo.data import tokenizer_fields  # noqa: E402
from hf_attn_zoo.train.recipe import load_recipe  # noqa: E402


def marian_config(zoo, ffn_dim: int, max_position_embeddings: int) -> MarianConfig:
    """The `MarianConfig` of a zoo encoder-decoder config `zoo`'s sizes, special tokens and dropout, with Marian's
    own layer (post-norm LayerNorm, biases, tokens scaled by sqrt(d_model), sinusoids, a SiLU MLP `ffn_dim` wide)."""
    return MarianConfig(
        vocab_size=zoo.vocab_size,
        d_model=zoo.hidden_size,
        encoder_layers=zoo.encoder_layers,
        decoder_layers=zoo.decoder_layers,
        encoder_attention_heads=zoo.num_attention_heads,
        decoder_attention_heads=zoo.num_attention_heads,
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        max_position_embeddings=max_position_embeddings,
        dropout=zoo.hidden_dropout,
        attention_dropout=zoo.attention_dropout,
        activation_dropout=0.0,
        activation_function="swish",
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=zoo.pad_token_id,
        bos_token_id=zoo.bos_token_id,
        eos_token_id=zoo.eos_token_id,
        forced_eos_token_id=zoo.eos_token_id,
        decoder_start_token_id=zoo.decoder_start_token_id,  # as the zoo's translators start
    )


def marian_like(recipe: str, tokenizer, seed: int = 0) -> MarianMTModel:
    """A fresh `MarianMTModel` of the zoo config `recipe` builds, with `tokenizer`'s vocabulary and special tokens,
    its MLP the zoo's plain width, or 1.5 times a gated one's (as many weights)."""
    model_args, data_args, _ = load_recipe(recipe)
    zoo = model_args.seq2seq_config(**tokenizer_fields(tokenizer), decoder_start_token_id=tokenizer.bos_token_id)
    # Marian's 512 sinusoids (a fixed table, no trained weights): the recipe trains on sources of max_source_length
    # tokens, but the test books hold longer verses, which a table of that length refuses
    positions = max(512, data_args.max_source_length, data_args.max_target_length + 1)
    # a plain MLP is Marian's own: the same width; a gated one's three matrices hold as many weights as two 1.5x wide
    width = zoo.intermediate_size if zoo.mlp_type == "plain" else 3 * zoo.intermediate_size // 2
    torch.manual_seed(seed)
    return MarianMTModel(marian_config(zoo, width, positions))


# The zoo config fields that make the zoo's MHA encoder-decoder layer Marian's: post-norm LayerNorm (eps 1e-5),
# biases, a plain SiLU MLP, tokens scaled by sqrt(d_model) beside sinusoids, the tokens and every Linear initialised
# at std 0.02 (no GPT-2 scaling of the projections into the residual stream).
MARIAN_CHOICES = {
    "norm_position": "post",
    "norm_type": "layernorm",
    "layer_norm_eps": 1e-5,
    "attention_bias": True,
    "mlp_bias": True,
    "mlp_type": "plain",
    "hidden_act": "silu",
    "scale_embedding": True,
    "embed_init_std": 0.02,
    "position_embedding_type": "sinusoidal",
    "scale_residual_init": False,
}
# Marian's names for the zoo's, inside a layer
MARIAN_NAMES = {
    "self_attn.out_proj": "self_attn.o_proj",
    "encoder_attn.out_proj": "encoder_attn.o_proj",
    "self_attn_layer_norm": "input_layernorm",
    "final_layer_norm": "post_attention_layernorm",
    "fc1": "mlp.up_proj",
    "fc2": "mlp.down_proj",
}


def zoo_twin(marian: MarianMTModel) -> PreTrainedModel:
    """The zoo's MHA encoder-decoder with Marian's layer (`MARIAN_CHOICES`), sizes and weights: Marian's function,
    but for the layout of the sinusoids (Marian's table puts the sines in the first half of the channels, the zoo's
    interleave sine and cosine) and a final LayerNorm the zoo's stacks end with (weight 1, bias 0, after a layer
    that already normalised). A Marian whose position tables hold the zoo's sinusoids computes the same logits
    (tests/test_seq2seq.py); a fresh one trains as Marian does (docs/translation.md measures it)."""
    from hf_attn_zoo.models import SEQ2SEQ

    config = marian.config
    if config.encoder_ffn_dim != config.decoder_ffn_dim or config.activation_function not in ("swish", "silu"):
        raise ValueError(
            f"the zoo's encoder-decoder has one MLP width and SiLU for both stacks: this Marian has encoder_ffn_dim="
            f"{config.encoder_ffn_dim}, decoder_ffn_dim={config.decoder_ffn_dim}, activation_function="
            f"{config.activation_function!r}."
        )
    fields = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_attention_heads": config.encoder_attention_heads,
        "num_key_value_heads": config.decoder_attention_heads,
        "cross_attention_num_key_value_heads": config.decoder_attention_heads,
        "num_hidden_layers": config.decoder_layers,
        "encoder_layers": config.encoder_layers,
        "decoder_layers": config.decoder_layers,
        "intermediate_size": config.encoder_ffn_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": True,
        **{name: getattr(config, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")},
        "decoder_start_token_id": config.decoder_start_token_id,
        **MARIAN_CHOICES,
    }
    zoo = SEQ2SEQ["mha"].build(None, **fields)
    weights = {}
    for name, tensor in marian.state_dict().items():
        if "embed_positions" in name or name == "final_logits_bias":  # fixed sinusoids; a zero bias
            continue
        for theirs, ours in MARIAN_NAMES.items():
            name = name.replace(theirs, ours)
        weights[name] = tensor
    missing, unexpected = zoo.load_state_dict(weights, strict=False)
    final_norms = {f"model.{stack}.norm.{kind}" for stack in ("encoder", "decoder") for kind in ("weight", "bias")}
    if set(missing) - final_norms - {"lm_head.weight"} or unexpected:
        raise ValueError(f"Marian's weights do not map onto the zoo's: missing {missing}, unexpected {unexpected}")
    zoo.tie_weights()
    return zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="the zoo translator's recipe (its model section sizes the control)")
    parser.add_argument("tokenizer", help="the tokenizer the zoo run trained (<output_dir>/tokenizer)")
    parser.add_argument("output", help="folder to write the fresh Marian checkpoint and the tokenizer to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = marian_like(args.recipe, tokenizer, args.seed)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    count = sum(p.numel() for p in model.parameters())
    print(f"MarianMTModel, {count / 1e6:.2f}M parameters, written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
