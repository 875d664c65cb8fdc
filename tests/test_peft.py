"""PEFT on every registered variant: LoRA (training through the Trainer, adapter save/reload, merging,
"all-linear") and prefix tuning (where a variant's cache holds per-layer keys and values; refused elsewhere)."""

import copy
import json

import pytest
import torch
from datasets import Dataset
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, PrefixTuningConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_attn_zoo.convert import to_llama
from hf_attn_zoo.lora import lora_table, lora_target_modules
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.clients_zoo import config_shaped_cache_refusal

from conftest import ATOL, tiny_model
from test_integrations import byte_model

# peft 0.21 reads `model.is_gradient_checkpointing`, which transformers 5.x deprecates: peft's to fix, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TEXT = "the quick brown fox jumps over the lazy dog. " * 12
BLOCK = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """32-wide models gain nothing from a second thread, and when the cores are busy the threads' spin-waits cost a
    lot (measured with a benchmark in the background: 0.2-1 s per training step on 2 threads, 7-16 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lora_model(name: str):
    """A tiny model of variant `name` with a large init: LoRA leaves the embedding and the head tied to it frozen,
    and at the default std of 0.02 that head is too small for any hidden state to move the logits far from uniform
    (measured over 8 steps: -0.1 to -0.3 nats; at 0.2: -1.2 to -2.2)."""
    return byte_model(name, intermediate_size=64, initializer_range=0.2)


def lora_free_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base weights of a (possibly LoRA-wrapped) model under their plain names, LoRA tensors dropped."""
    state = model.state_dict()
    return {name.replace(".base_layer", ""): tensor for name, tensor in state.items() if "lora_" not in name}


def wrapped_names(model: nn.Module) -> set[str]:
    """The last name component of every module that peft gave a LoRA adapter."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def adapted(request, tmp_path_factory):
    """Per variant, once: a byte-level model saved as a base folder, reloaded (so the adapter records that folder),
    LoRA-wrapped with `lora_target_modules`, trained a few Trainer steps and saved as an adapter."""
    name = request.param
    root = tmp_path_factory.mktemp(f"peft-{name}")
    model, tokenizer = lora_model(name)
    model.save_pretrained(root / "base")
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    before = {key: tensor.clone() for key, tensor in lora_free_state(base).items()}

    ids = tokenizer(TEXT).input_ids
    blocks = [ids[i : i + BLOCK] for i in range(0, len(ids) - BLOCK, BLOCK)]
    probe = torch.tensor(blocks[:4])  # a fixed batch: loss before and after training, logits for every comparison

    torch.manual_seed(0)
    peft_model = get_peft_model(
        base, LoraConfig(target_modules=lora_target_modules(base), r=4, lora_alpha=8, task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        loss_before = peft_model.eval()(probe, labels=probe).loss.item()
    args = TrainingArguments(
        output_dir=str(root / "trainer"),
        per_device_train_batch_size=4,
        max_steps=8,
        learning_rate=1e-2,  # a high rate so that 8 steps move the loss clearly
        lr_scheduler_type="constant",
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(
        model=peft_model, args=args, train_dataset=Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    ).train()
    peft_model.eval()
    with torch.no_grad():
        out = peft_model(probe, labels=probe)
    peft_model.save_pretrained(root / "adapter")
    return {
        "name": name,
        "root": root,
        "model": peft_model,
        "before": before,
        "probe": probe,
        "loss_before": loss_before,
        "loss_after": out.loss.item(),
        "logits": out.logits,
    }


def test_training_lowers_the_loss_and_changes_only_lora_weights(adapted):
    model = adapted["model"]
    assert adapted["loss_after"] < adapted["loss_before"] - 0.5, (adapted["loss_before"], adapted["loss_after"])
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert trainable and all("lora_" in name for name in trainable), trainable
    assert wrapped_names(model) == set(lora_target_modules(model))
    after = lora_free_state(model.get_base_model())
    assert after.keys() == adapted["before"].keys()
    changed = [key for key, tensor in after.items() if not torch.equal(tensor, adapted["before"][key])]
    assert not changed, changed
    # lora_B starts at zero: the adapters did move
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_adapter_reloads_with_peft_model_and_auto_peft_model(adapted):
    root, probe = adapted["root"], adapted["probe"]
    saved = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(root / "base")
    assert not (root / "adapter" / "model.safetensors").exists()  # the adapter alone, not the base weights
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    for reloaded in (
        PeftModel.from_pretrained(base, root / "adapter"),
        AutoPeftModelForCausalLM.from_pretrained(root / "adapter"),
    ):
        with torch.no_grad():
            logits = reloaded.eval()(probe).logits
        torch.testing.assert_close(logits, adapted["logits"], rtol=0, atol=0)


def test_merge_and_unload_equals_the_adapted_model(adapted):
    merged = copy.deepcopy(adapted["model"]).merge_and_unload()
    assert type(merged) is VARIANTS[adapted["name"]].causal_lm_class
    assert not any("lora_" in name or "base_layer" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        logits = merged.eval()(adapted["probe"]).logits
    torch.testing.assert_close(logits, adapted["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_all_linear_wraps_the_documented_modules_and_merges(name):
    model, tokenizer = lora_model(name)
    ids = torch.tensor([tokenizer(TEXT[:40]).input_ids])
    with torch.no_grad():
        base_logits = model.eval()(ids).logits
    # random lora_B (not zero) so that the adapter changes the output and merging has something to get wrong
    config = LoraConfig(target_modules="all-linear", r=4, init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    # peft skips the output head (tied to the embedding); what remains is exactly the documented list
    assert wrapped_names(peft_model) == set(lora_target_modules(model))
    assert not hasattr(peft_model.get_base_model().lm_head, "lora_A")

    loss = peft_model.train()(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)

    with torch.no_grad():
        adapted_logits = peft_model.eval()(ids).logits
        assert not torch.allclose(adapted_logits, base_logits)
        merged = peft_model.merge_and_unload()
        assert type(merged) is VARIANTS[name].causal_lm_class
        # merging adds s·BA into W: the same sums, reassociated, whose rounding scales with the logits (up to ~5
        # with this init and random adapters), so 1e-5 relative to their largest
        scale = adapted_logits.abs().max().item()
        torch.testing.assert_close(merged(ids).logits, adapted_logits, rtol=0, atol=ATOL * scale)


def test_lora_target_modules_cover_every_variant():
    for name in VARIANTS:
        assert VARIANTS[name].lora_targets, f"{name} declares no LoRA target modules"
        model = tiny_model(name)
        linear = {key.rsplit(".", 1)[-1] for key, module in model.named_modules() if isinstance(module, nn.Linear)}
        targets = VARIANTS[name].lora_targets_for(model.config)
        missing = set(targets) - linear
        assert not missing, f"{name}: {sorted(missing)} are not nn.Linear modules of the variant"
        # the helper finds the list from a config or a model, and the default config's from a name or a model type
        for key in (model.config, model):
            assert lora_target_modules(key) == targets
        default = VARIANTS[name].build("tiny", vocab_size=97)
        for key in (name, model.config.model_type):
            assert lora_target_modules(key) == VARIANTS[name].lora_targets == lora_target_modules(default)
    table = lora_table().splitlines()
    assert table[0] == "| variant | target_modules |" and len(table) == 2 + len(VARIANTS)
    with pytest.raises(ValueError, match="unknown variant"):
        lora_target_modules("zoo_nonexistent")


# prefix tuning: PEFT's virtual tokens are keys and values of num_key_value_heads x head_dim in every layer's cache
PREFIX_CASES = [(name, {}) for name in sorted(VARIANTS)] + [("additive", {"additive_dim": 16})]  # keys != values wide


def prefix_case_id(case) -> str:
    return case if isinstance(case, str) else "-".join(f"{key}={value}" for key, value in case.items())


@pytest.mark.parametrize("name, fields", PREFIX_CASES, ids=prefix_case_id)
def test_prefix_tuning_trains_and_generates_or_is_refused_naming_it(name, fields):
    model, tokenizer = lora_model(name) if not fields else byte_model(name, intermediate_size=64, **fields)
    attention = VARIANTS[name].attention_class
    refusal = config_shaped_cache_refusal(attention, model.config)
    prefixed = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    batch = tokenizer([TEXT[:BLOCK]], return_tensors="pt")
    if refusal is not None:  # a state, or keys and values of their own widths: refused at the first forward
        with pytest.raises(TypeError, match=rf"^{model.config.model_type} .*prefix tuning.* cannot apply"):
            prefixed(**batch, labels=batch.input_ids)
        return
    # the virtual keys are as wide as what the variant caches (differential: its two key maps side by side)
    virtual = prefixed.get_prompt(batch_size=1).layers[0]
    heads, key_width, value_width = attention.cached_widths(model.config)
    assert virtual.keys.shape == (1, heads, 4, key_width) and virtual.values.shape[-1] == value_width

    trainable = {name for name, parameter in prefixed.named_parameters() if parameter.requires_grad}
    assert trainable and all("prompt_encoder" in name for name in trainable)
    optimizer = torch.optim.AdamW([p for p in prefixed.parameters() if p.requires_grad], lr=0.05)
    prefixed.train()
    losses = []
    for _ in range(8):
        loss = prefixed(**batch, labels=batch.input_ids).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]

    prefixed.eval()
    prompt = tokenizer(["the quick", "a"], return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = prefixed.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert generated.shape == (2, prompt.input_ids.shape[1] + 5)
        without = prefixed.get_base_model()(**prompt).logits
        assert not torch.allclose(prefixed(**prompt).logits, without, atol=1e-3)  # the prefix is read


@pytest.mark.parametrize("name", [name for name in sorted(VARIANTS) if VARIANTS[name].family == "mha"])
def test_prefix_tuning_on_the_mha_family_generates_what_llama_generates(name):
    """The same weights and the same virtual tokens: a Llama control and the zoo model give the same tokens through
    PEFT's prefix-tuned `generate` (whatever PEFT's own conventions for the prefix's positions are)."""
    model, tokenizer = lora_model(name)
    llama = to_llama(model)
    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    zoo_prefixed, llama_prefixed = get_peft_model(model, config), get_peft_model(llama, copy.deepcopy(config))
    with torch.no_grad():
        for parameter in zoo_prefixed.prompt_encoder.parameters():
            parameter.normal_(0, 1.0)  # a prefix that changes what is generated
    llama_prefixed.prompt_encoder.load_state_dict(zoo_prefixed.prompt_encoder.state_dict())
    prompt = tokenizer(["the quick", "a"], return_tensors="pt", padding=True)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(
            zoo_prefixed.eval().generate(**prompt, **greedy), llama_prefixed.eval().generate(**prompt, **greedy)
        )
