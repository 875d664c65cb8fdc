"""Model cards: the README.md every saved checkpoint carries, with Hub metadata."""

from .models import get_variant


def model_card(config, training: dict | None = None) -> str:
    """A model card for a zoo model: YAML metadata (library, tags, pipeline), what the variant is, its paper and
    size, and, when `training` is given, what it was trained on and the perplexity it reached."""
    variant = get_variant(config.model_type)
    tags = ["hf-attn-zoo", variant.name, config.model_type, "text-generation"]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        *[f"- {tag}" for tag in tags],
        "---",
        "",
        f"# {config.model_type}",
        "",
        f"A `{variant.name}` model from [hf_attn_zoo](https://pypi.org/project/hf-attn-zoo/): {variant.description}.",
        f"Paper: {variant.paper}.",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    fields = (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "position_embedding_type",
        "vocab_size",
        "max_position_embeddings",
    )
    lines += [f"| {name} | {getattr(config, name)} |" for name in fields]
    if training:
        lines += ["", "## Training", ""]
        lines += [f"- {key.replace('_', ' ')}: {value}" for key, value in training.items()]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "# trust_remote_code runs the model code saved with the weights; with `import hf_attn_zoo` it is not needed",
        'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
    ]
    return "\n".join(lines)
