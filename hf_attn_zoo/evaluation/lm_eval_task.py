"""lm-evaluation-harness over local text files, so that nothing is downloaded.

`write_task(files, folder)` writes a task (`zoo_text` unless named otherwise) that scores each file as one document
with `loglikelihood_rolling`, reporting lm-eval's word perplexity, byte perplexity and bits per byte, the metrics of
its wikitext task. Then, for a zoo checkpoint (its code travels with it):

    lm_eval --model hf --model_args pretrained=CHECKPOINT,trust_remote_code=True \\
        --include_path FOLDER --tasks zoo_text

or `hf-attn-zoo lm-eval-task --data FILE... --out FOLDER`, which writes the task and prints that command.
"""

import json
import os
from pathlib import Path

TEMPLATE = """# Written by hf_attn_zoo.evaluation.lm_eval_task: every file below is one document, scored whole.
task: {name}
dataset_path: text
dataset_kwargs:
  data_files:
    test: {files}
  sample_by: document
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def write_task(files: list[str | os.PathLike], folder: str | os.PathLike, name: str = "zoo_text") -> Path:
    """Write the task YAML for `files` into `folder` (the `--include_path` of lm_eval); returns its path."""
    paths = [str(Path(f).resolve()) for f in files]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"not files: {missing}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    task = folder / f"{name}.yaml"
    task.write_text(TEMPLATE.format(name=name, files=json.dumps(paths)))
    return task


def command(checkpoint: str, folder: str | os.PathLike, name: str = "zoo_text") -> str:
    import torch

    device = "" if torch.cuda.is_available() else " --device cpu"  # lm-eval's hf model asks for CUDA by default
    return (
        f"lm_eval --model hf --model_args pretrained={checkpoint},trust_remote_code=True "
        f"--include_path {folder} --tasks {name}{device}"
    )
