"""Model cards: the README.md every saved checkpoint carries, with Hub metadata.

The metadata is what the Hub indexes: `library_name` (which code loads the model), `pipeline_tag`, `tags` (the
package, the variant, and `arxiv:ID` for the paper, which the Hub links), `datasets` when the model was trained on a
Hub dataset, and a `model-index` entry with the measured perplexity when there is one. What the card says about the
variant (its description, paper, arXiv ids) is read off its config class.

This module travels with every checkpoint (`save_pretrained` writes the card, also as remote code): it imports only
yaml and huggingface_hub, both required by transformers.
"""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

# Keys of `training` that go into the metadata too (the body lists every key); spaces or underscores alike.
DATASET_KEY = "dataset"  # a Hub dataset id
DATA_KEY = "data"  # a description of the training data: files, a corpus
PERPLEXITY_KEY = "validation perplexity"

# The sentence of the generic card transformers' `push_to_hub` writes for a repo that has none
# (`transformers.utils.hub.create_and_tag_model_card`).
GENERIC_CARD_MARK = "This model card has been automatically generated."


def _lookup(training: Mapping, key: str):
    return next((value for name, value in training.items() if name.replace("_", " ") == key), None)


def card_metadata(config, training: Mapping | None = None, tags: Sequence[str] = (), name: str | None = None) -> dict:
    """The YAML metadata of a zoo model's card, as a dict (see the module docstring)."""
    training = training or {}
    papers = [f"arxiv:{arxiv_id}" for arxiv_id in config.arxiv]
    own_tags = ["hf-attn-zoo", config.variant_name, config.model_type, "text-generation", *papers]
    metadata = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": list(dict.fromkeys([*own_tags, *tags])),  # in order, once each
    }
    dataset, data = _lookup(training, DATASET_KEY), _lookup(training, DATA_KEY)
    if dataset:
        metadata["datasets"] = [str(dataset)]
    perplexity = _lookup(training, PERPLEXITY_KEY)
    if perplexity is not None:
        metadata["model-index"] = [
            {
                "name": name or config.model_type,
                "results": [
                    {
                        "task": {"type": "text-generation", "name": "Causal language modeling"},
                        "dataset": {
                            "name": str(dataset or data or "held-out validation split"),
                            "type": str(dataset or "text"),
                        },
                        "metrics": [
                            {"type": "perplexity", "value": float(perplexity), "name": "Validation perplexity"}
                        ],
                    }
                ],
            }
        ]
    return metadata


def model_card(
    config,
    training: dict | None = None,
    *,
    tags: Sequence[str] = (),
    repo_id: str | None = None,
) -> str:
    """A model card for a zoo model: YAML metadata (library, tags, pipeline, paper, data, perplexity), what the
    variant is, its paper and size, and, when `training` is given, what it was trained on and the perplexity it
    reached. `tags` are added to the card's own; `repo_id` names the model in the card (a path placeholder
    otherwise)."""
    metadata = card_metadata(config, training, tags, name=repo_id.split("/")[-1] if repo_id else None)
    links = ", ".join(f"[arXiv:{arxiv_id}](https://arxiv.org/abs/{arxiv_id})" for arxiv_id in config.arxiv)
    source = repo_id or "PATH"
    lines = [
        "---",
        yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True).rstrip("\n"),
        "---",
        "",
        f"# {repo_id or config.model_type}",
        "",
        f"A `{config.variant_name}` model from the `hf_attn_zoo` package: {config.description}.",
        f"Paper: {config.paper}{f' ({links})' if links else ''}.",
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
        f'model = AutoModelForCausalLM.from_pretrained("{source}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{source}", trust_remote_code=True)',
        "```",
        "",
    ]
    return "\n".join(lines)


def write_card(
    folder: str | os.PathLike,
    config,
    training: dict | None = None,
    *,
    repo_id: str | None = None,
    replace_generic: bool = False,
) -> bool:
    """Write the zoo card to `folder/README.md` unless the folder has a card already, which is kept (a trainer's
    card with training details, one edited by hand). With `replace_generic`, transformers' generic card counts as
    none: it is replaced, its tags (`push_to_hub(tags=...)`) kept. Returns whether a card was written."""
    path = Path(folder) / "README.md"
    tags: Sequence[str] = ()
    if path.exists():
        text = path.read_text(encoding="utf-8")
        if not (replace_generic and GENERIC_CARD_MARK in text):
            return False
        from huggingface_hub import ModelCard

        tags = ModelCard(text).data.tags or ()
    path.write_text(model_card(config, training, tags=tags, repo_id=repo_id), encoding="utf-8")
    return True
