"""Train a zoo model from a YAML recipe: `python training/train.py CONFIG [--section.field value ...]`.

The same code path as `hf-attn-zoo train`, for launchers that want a script:
    torchrun --nproc_per_node 2 training/train.py configs/train/tiny_gqa.yaml
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml training/train.py configs/train/tiny_gqa.yaml
"""

from hf_attn_zoo.training import main

if __name__ == "__main__":
    main()
