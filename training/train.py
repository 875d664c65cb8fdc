"""Train a zoo model from a YAML recipe: `python training/train.py CONFIG [--section.field value ...]`.

The same code path as `hf-attn-zoo train`, for launchers that want a script:
    torchrun --nproc_per_node 2 training/train.py configs/train/tiny_gqa.yaml
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml training/train.py configs/train/tiny_gqa.yaml

A mistake in the recipe, an override or the launch (`hf_attn_zoo.errors.UserError`) is one line on stderr and exit
status 2, as with `hf-attn-zoo train`; any other exception is a bug and keeps its traceback.
"""

import os
import sys

from hf_attn_zoo.errors import UserError, report
from hf_attn_zoo.train import main


def run() -> int:
    try:
        main()
    except UserError as error:
        # every process of a launch reads the same recipe and fails alike: one line, from the first, is enough
        if int(os.environ.get("RANK", "0")) == 0:
            return report(error, os.path.basename(sys.argv[0]))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run())
