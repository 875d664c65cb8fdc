"""What a saved checkpoint says about itself, and what loading one says when it does not fit its config.

- `auto_map_for`: transformers writes only the saved class into `auto_map`; a zoo checkpoint names its config, base
  model and every head, so it loads with `trust_remote_code=True` through any of the Auto classes.
- `ShapeCheckedLoading` (`CheckpointMismatchError`, `describe_mismatch`): a tensor whose shape differs from what the
  config builds is reported with the config fields that size it, as declared by the module that owns the tensor
  (`sized_by`).

This module travels with every checkpoint (remote code): it imports only torch.
"""

from torch import nn


def auto_map_for(base_model_class) -> dict[str, str]:
    """`auto_map` naming every class of the variant built on `base_model_class` (config, base model and each
    head, `base_model_class.heads`), as `<module file>.<class>`."""

    def name(cls: type) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    auto_map = {"AutoConfig": name(base_model_class.config_class), "AutoModel": name(base_model_class)}
    return auto_map | {auto_class: name(head) for auto_class, head in base_model_class.heads.items()}


class CheckpointMismatchError(ValueError, RuntimeError):
    """Weights whose shapes do not fit the config: a `ValueError` (bad input) that is also the `RuntimeError`
    transformers raises for it, so code written against either catches it."""


def sizing_fields(model: nn.Module, key: str) -> str:
    """The config fields that size the tensor `key` of `model`, as declared by the module that owns it: the
    nearest module on the path whose `sized_by` names the next step (`self_attn` names `q_proj`, ...)."""
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        try:
            owner = model.get_submodule(".".join(parts[: depth - 1]))
        except AttributeError:
            continue
        fields = getattr(owner, "sized_by", {}).get(parts[depth - 1])
        if fields:
            return fields
    return "the variant's own fields"


def describe_mismatch(source, model: nn.Module, mismatched: list) -> str:
    config = model.config
    lines = [f"the weights in {source} do not fit the model its config describes ({config.model_type}):"]
    for key, checkpoint_shape, model_shape in sorted(mismatched)[:8]:
        lines.append(
            f"  {key}: checkpoint {list(checkpoint_shape)}, config builds {list(model_shape)} "
            f"(sized by {sizing_fields(model, key)})"
        )
    if len(mismatched) > 8:
        lines.append(f"  ... and {len(mismatched) - 8} more")
    lines.append(
        "Restore the config.json saved with these weights, or pass ignore_mismatched_sizes=True to initialise the "
        "tensors that do not fit afresh."
    )
    return "\n".join(lines)


class ShapeCheckedLoading:
    """Mixed into a `PreTrainedModel` before it: `from_pretrained` with a clearer error for weights whose shape does
    not fit the config."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, with a clearer error for weights whose shape does not fit the config.

        As in transformers, missing and unexpected tensors are reported (a warning, and `output_loading_info=True`)
        and missing ones are initialised by `_init_weights`: a base-model checkpoint loads into the causal LM. A
        tensor whose shape differs from what the config builds is an error naming the tensor and the config fields
        that size it, unless `ignore_mismatched_sizes=True` (then it is initialised afresh, as transformers does).
        """
        accept_mismatch = kwargs.pop("ignore_mismatched_sizes", False)
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path,
            *model_args,
            ignore_mismatched_sizes=True,  # loaded to build the message below; refused unless asked for
            output_loading_info=True,
            **kwargs,
        )
        if info["mismatched_keys"] and not accept_mismatch:
            raise CheckpointMismatchError(
                describe_mismatch(pretrained_model_name_or_path, model, info["mismatched_keys"])
            )
        return (model, info) if return_info else model
