"""LoRA (Hu et al. 2021) on the non-attention weights of a converted model (`convert.lora_rank`): while a
conversion is uptrained or distilled, the new attention trains in full and each MLP projection only through a
low-rank update `W + (alpha / r)·B·A` (B starts at zero, so training starts from the parent's function); the MLPs'
biases, the token embeddings and the output head stay frozen, the norms train. At the end the updates are merged into
the weights: the saved model is a plain zoo checkpoint.

The update is a `torch.nn.utils.parametrize` parametrization of the projection's weight rather than a PEFT wrapper:
the model keeps its class and one state-dict layout from the first checkpoint to the last, so that resuming and
`training.average_checkpoints` read checkpoints as they read every other run's, where a `PeftModel` would save the
adapters apart from the attention trained in full.
"""

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..errors import UserError
from ..models.layers_zoo import ZooMLP

__all__ = ["LowRankUpdate", "add_mlp_lora", "merge_lora"]


class LowRankUpdate(nn.Module):
    """The parametrization `weight -> weight + scaling·B·A` with A (r, in) at PEFT's Kaiming-uniform init and B
    (out, r) at zero."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # (out, r) @ (r, in) -> (out, in): a rank-r change of the frozen weight
        return weight + (self.lora_B @ self.lora_A).to(weight.dtype) * self.scaling


def mlp_projections(model: nn.Module) -> list[nn.Linear]:
    """Every MLP projection of a zoo model (gate, up, down of each layer's `ZooMLP`)."""
    names = ZooMLP.lora_targets
    return [
        projection
        for module in model.modules()
        if isinstance(module, ZooMLP)
        for projection in (getattr(module, name) for name in names)
        if projection is not None
    ]


def add_mlp_lora(model: nn.Module, rank: int, alpha: float | None = None) -> int:
    """Freeze `model`'s MLP weights and biases, token embeddings and output head, and give every MLP projection a
    rank-`rank` update (`alpha` defaults to 2·rank, PEFT's common choice). Returns the number of trainable
    parameters."""
    projections = mlp_projections(model)
    if not projections:
        raise UserError(
            f"convert.lora_rank={rank}: this {model.config.model_type} model has no MLP to adapt (mlp_type="
            f"{getattr(model.config, 'mlp_type', None)!r}); leave convert.lora_rank empty."
        )
    for projection in projections:
        out_features, in_features = projection.weight.shape
        update = LowRankUpdate(out_features, in_features, rank, 2.0 * rank if alpha is None else alpha)
        parametrize.register_parametrization(projection, "weight", update.to(projection.weight.device))
        projection.parametrizations.weight.original.requires_grad_(False)
        if projection.bias is not None:
            projection.bias.requires_grad_(False)
    model.get_input_embeddings().requires_grad_(False)
    if (head := model.get_output_embeddings()) is not None:
        head.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merge_lora(model: nn.Module) -> None:
    """Fold every low-rank update into its weight and make the model a plain one again, every weight trainable."""
    for projection in mlp_projections(model):
        if parametrize.is_parametrized(projection, "weight"):
            parametrize.remove_parametrizations(projection, "weight", leave_parametrized=True)
    model.requires_grad_(True)
