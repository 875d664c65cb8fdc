"""The main job: train a small zoo model on Python's standard library for a few minutes on CPU, report its
validation perplexity against the unigram baseline of the same data, generate a sample, and reload the saved
checkpoint through the Auto classes.

It runs `hf_attn_zoo.train.run_training`, the code path of `hf-attn-zoo train`, with a recipe written here so
that it needs nothing but the installed package.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .data import DataArguments
from .models import get_variant
from .train import ModelArguments, ZooTrainingArguments, run_training
from .train.trainer import complete_checkpoints

if TYPE_CHECKING:
    from hf_attn_zoo_cli import DemoOptions

# A small model: 4 layers x 192 (2.6M parameters with the 4096-token vocabulary); heads follow each variant's own
# defaults beyond the count given here (single-head and AFT variants take no head count).
DEMO_CONFIG = {"hidden_size": 192, "num_hidden_layers": 4, "max_position_embeddings": 256}


def demo_recipe(options: DemoOptions) -> tuple[ModelArguments, DataArguments, ZooTrainingArguments]:
    """The demo's recipe, as `hf-attn-zoo train` would parse it."""
    variant = get_variant(options.variant)
    config = dict(DEMO_CONFIG)
    if variant.config_class().num_attention_heads > 1:  # variants with several heads: 6 of width 32
        config["num_attention_heads"] = 6
    output_dir = Path(options.output_dir)
    model_args = ModelArguments(variant=variant.name, size=None, config=json.dumps(config))
    data_args = DataArguments(
        vocab_size=4096,
        block_size=128,
        num_proc=2,
        max_documents=options.max_documents,
        seed=options.seed,
        packing=options.packing,
    )
    training_args = ZooTrainingArguments(
        output_dir=str(output_dir),
        max_steps=options.max_steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, options.max_steps // 20),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=max(1, options.max_steps // 10),
        save_steps=max(1, options.max_steps // 2),
        save_total_limit=1,
        dataloader_drop_last=True,
        dataloader_pin_memory=torch.cuda.is_available(),
        report_to=["tensorboard"],
        resume_from_checkpoint="latest" if complete_checkpoints(output_dir) else None,
        seed=options.seed,
    )
    return model_args, data_args, training_args


def run_demo(options: DemoOptions) -> dict:
    start = time.perf_counter()
    variant = get_variant(options.variant)
    summary = run_training(*demo_recipe(options))
    final = Path(summary["final_model"])
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    inputs = tokenizer(options.prompt, return_tensors="pt")
    torch.manual_seed(options.seed)
    generated = model.generate(
        **inputs, max_new_tokens=options.max_new_tokens, do_sample=True, top_k=40, temperature=0.8
    )
    sample = tokenizer.decode(generated[0], skip_special_tokens=True)
    print(
        f"\n{variant.model_type}: {summary['parameters'] / 1e6:.2f}M parameters, {summary['steps']} steps, "
        f"{summary['train_tokens']:,} tokens in {summary['seconds']:.0f} s "
        f"({summary['train_tokens'] / max(summary['seconds'], 1e-9):,.0f}/s)"
    )
    print(
        f"validation perplexity {summary['validation_perplexity']:.2f}; unigram baseline of the same data "
        f"{summary['unigram_perplexity']:.2f}"
    )
    print(f"sample:\n{sample}\n")
    print(
        f"checkpoint {final} (reload: AutoModelForCausalLM.from_pretrained({str(final)!r})); "
        f"{time.perf_counter() - start:.0f} s in all"
    )
    return {**summary, "sample": sample}
