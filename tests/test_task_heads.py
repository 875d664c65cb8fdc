"""Task heads: a sequence classifier fine-tuned from a saved causal LM with a plain `transformers.Trainer`."""

import pickle
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from hf_attn_zoo.models import VARIANTS

from conftest import VOCAB_SIZE, tiny_model

# one variant of each family: scaled dot product, window, compressed keys, attention-free, top-k, additive score,
# linear (running sums of a feature map), block-sparse (window, global and random blocks), a selective state space
# (Mamba)
FAMILIES = ["gqa", "sliding_window", "linformer", "aft_simple", "topk", "additive", "linear", "bigbird", "mamba"]


def separable_examples(count: int, seed: int) -> list[dict]:
    """Rows of 6-12 tokens: class 0 draws its tokens from [3, 40), class 1 from [50, VOCAB_SIZE)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        label = int(torch.randint(0, 2, (), generator=generator))
        length = int(torch.randint(6, 13, (), generator=generator))
        low, high = (3, 40) if label == 0 else (50, VOCAB_SIZE)
        examples.append({"input_ids": torch.randint(low, high, (length,), generator=generator), "labels": label})
    return examples


def left_pad(examples: list[dict]) -> dict:
    width = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.zeros(len(examples), width, dtype=torch.long)  # pad_token_id = 0
    attention_mask = torch.zeros_like(input_ids)
    for i, example in enumerate(examples):
        input_ids[i, width - len(example["input_ids"]) :] = example["input_ids"]
        attention_mask[i, width - len(example["input_ids"]) :] = 1
    labels = torch.tensor([example["labels"] for example in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.mark.parametrize("name", FAMILIES)
def test_sequence_classifier_fine_tunes_from_a_causal_lm_checkpoint(name, tmp_path):
    tiny_model(name, initializer_range=0.02).save_pretrained(tmp_path / "lm")
    model, info = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "lm", num_labels=2, output_loading_info=True
    )
    assert type(model) is VARIANTS[name].heads["AutoModelForSequenceClassification"]
    assert info["missing_keys"] == {"score.weight"}  # the new head, initialised by _init_weights
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=40,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        warmup_steps=0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=separable_examples(640, 0), data_collator=left_pad)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    held_out = left_pad(separable_examples(200, 1))
    model.eval()
    with torch.no_grad():
        predicted = model(input_ids=held_out["input_ids"], attention_mask=held_out["attention_mask"]).logits.argmax(-1)
    accuracy = (predicted == held_out["labels"]).float().mean().item()
    assert accuracy > 0.9, accuracy  # chance is 0.5


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_head_is_a_module_attribute_under_its_name(name):
    """The heads a variant file binds from `variant_heads` live where `auto_map`, remote-code loading and pickle look
    for them: the variant's module, under their own name, with their own qualified name."""
    model_class = VARIANTS[name].causal_lm_class.base_model_class
    assert set(model_class.heads) == {
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification",
        "AutoModelForQuestionAnswering",
    }
    module = sys.modules[model_class.__module__]
    for head in model_class.heads.values():
        assert head.__module__ == model_class.__module__ and head.__qualname__ == head.__name__
        assert getattr(module, head.__name__) is head, head.__name__
        assert head.base_model_class is model_class and head.config_class is model_class.config_class
    model = VARIANTS[name].causal_lm_class(tiny_model(name).config)
    assert type(pickle.loads(pickle.dumps(model))) is type(model)
