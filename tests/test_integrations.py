"""The transformers machinery users reach for first: pipelines (with and without the package), the Trainer."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, pipeline

from hf_attn_zoo.data import byte_level_tokenizer, tokenizer_fields
from hf_attn_zoo.models import VARIANTS

from conftest import CONFORMANCE


def byte_model(name: str, **overrides):
    """A tiny `name` model (seeded) with the byte-level tokenizer; `overrides` are config fields."""
    tokenizer = byte_level_tokenizer()
    fields = dict(hidden_size=32, num_hidden_layers=2, max_position_embeddings=128, **CONFORMANCE[name]["config"])
    config = VARIANTS[name].config(**tokenizer_fields(tokenizer), **{**fields, **overrides})
    torch.manual_seed(0)
    return VARIANTS[name].causal_lm_class(config), tokenizer


PROMPTS = ["hello", "a longer prompt"]


def pipeline_texts(folder, **kwargs) -> list[str]:
    generator = pipeline("text-generation", model=str(folder), **kwargs)
    return [out[0]["generated_text"] for out in generator(PROMPTS, max_new_tokens=6, do_sample=False)]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_text_generation_pipeline_from_a_checkpoint(name, tmp_path):
    model, tokenizer = byte_model(name)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    expected = []
    for prompt in PROMPTS:  # what generate() gives for each prompt alone
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected.append(tokenizer.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0]))
    assert pipeline_texts(tmp_path) == expected


PIPELINE_WITHOUT_PACKAGE = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_attn_zoo"] = None  # any attempt to import the package now fails
    from transformers import pipeline

    texts = {}
    for folder in sys.argv[1:]:
        generator = pipeline("text-generation", model=folder, trust_remote_code=True)
        assert type(generator.model).__module__.startswith("transformers_modules."), type(generator.model).__module__
        out = generator(json.loads(open(folder + "/prompts.json").read()), max_new_tokens=6, do_sample=False)
        texts[folder] = [row[0]["generated_text"] for row in out]
    print(json.dumps(texts))
    """
)


def test_text_generation_pipeline_without_the_package(tmp_path):
    expected = {}
    for name in VARIANTS:
        model, tokenizer = byte_model(name)
        folder = tmp_path / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "prompts.json").write_text(json.dumps(PROMPTS))
        expected[str(folder)] = pipeline_texts(folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", PIPELINE_WITHOUT_PACKAGE, *expected],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_trainer_lowers_the_loss(tmp_path):
    model, tokenizer = byte_model("gqa")
    text = "the quick brown fox jumps over the lazy dog. " * 40
    ids = tokenizer(text).input_ids
    blocks = [ids[i : i + 64] for i in range(0, len(ids) - 64, 64)]
    dataset = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=30,
        learning_rate=3e-3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        gradient_accumulation_steps=2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert math.log(len(tokenizer)) - 0.5 < losses[0] and losses[-1] < losses[0] - 1.0, losses
    trainer.save_model(tmp_path / "final")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert reloaded.config.auto_map["AutoModelForCausalLM"] == "mha.ZooGQAForCausalLM"
