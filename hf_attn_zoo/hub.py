"""Pushing a saved checkpoint to the Hugging Face Hub: `hf-attn-zoo push CHECKPOINT REPO`.

`model.push_to_hub(repo)` and `tokenizer.push_to_hub(repo)` work on loaded objects (a zoo model's push writes the
zoo model card, see `ZooPreTrainedModel._upload_modified_files`). This uploads a checkpoint folder as it is on disk —
weights, config with `auto_map`, the model code, tokenizer, model card — in one commit, without loading anything, and
leaves out what only resuming a training run needs.
"""

import json
import os
import warnings
from pathlib import Path
from urllib.parse import quote

from huggingface_hub import HfApi
from transformers import AutoConfig

from .cards import write_card
from .loading import check_model_folder
from .models import VARIANTS

# Trainer state in a `checkpoint-N` folder: resuming needs it, a model repo does not.
TRAINING_STATE = [
    "optimizer.pt",
    "optimizer.bin",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.bin",
    "checkpoint_complete.json",
    "runs/*",
]

# training_summary.json (hf_attn_zoo.train) fields that a card made for a pushed checkpoint reports
SUMMARY_FIELDS = {
    "validation_perplexity": "validation perplexity",
    "unigram_perplexity": "unigram baseline perplexity",
    "steps": "steps",
    "train_tokens": "train tokens",
}


def push_checkpoint(folder: str | os.PathLike, repo: str, revision: str | None = None, private: bool = False) -> str:
    """Upload the checkpoint `folder` to the model repo `repo` (created if missing, `private` then) on branch
    `revision` (created from main if missing; default main), and return the URL of what was pushed.

    A folder without README.md gets the zoo model card first, with the figures of its `training_summary.json` when
    there is one, so the repo and the folder carry the same card; an existing README.md is uploaded as it is.
    The endpoint and token are huggingface_hub's (`HF_ENDPOINT`, `HF_TOKEN` or `hf auth login`).
    """
    folder = Path(folder)
    check_model_folder(folder, tokenizer=False)  # a model without its tokenizer can be pushed: warned below
    if not (folder / "tokenizer_config.json").is_file():
        warnings.warn(f"{folder} has no tokenizer (tokenizer_config.json): only the model is pushed", stacklevel=2)
    api = HfApi()
    repo_id = api.create_repo(repo, private=private, exist_ok=True).repo_id  # the namespace filled in
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    zoo_model = model_type in {variant.model_type for variant in VARIANTS.values()}
    if zoo_model and not (folder / "README.md").exists():  # other models' folders go up as they are
        config = AutoConfig.from_pretrained(folder)  # the package's registered class: no code from the folder runs
        summary_file = folder / "training_summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        training = {label: summary[key] for key, label in SUMMARY_FIELDS.items() if key in summary}
        write_card(folder, config, training or None, repo_id=repo_id)
    api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        revision=revision,
        commit_message=f"Upload {folder.name} with hf-attn-zoo",
        ignore_patterns=TRAINING_STATE,
    )
    url = f"{api.endpoint}/{repo_id}"
    return url if revision is None else f"{url}/tree/{quote(revision, safe='')}"
