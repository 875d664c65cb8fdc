"""Checkpoints: safetensors, `auto_map`, and `trust_remote_code` loading where hf_attn_zoo is not importable."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.dynamic_module_utils import get_imports

from hf_attn_zoo.models import VARIANTS

from conftest import CASES, left_padded_batch, tiny_model


def test_auto_map_and_files(tmp_path):
    model = tiny_model("gqa")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "mha.ZooGQAConfig",
        "AutoModel": "mha.ZooGQAModel",
        "AutoModelForCausalLM": "mha.ZooGQAForCausalLM",
        "AutoModelForSequenceClassification": "mha.ZooGQAForSequenceClassification",
        "AutoModelForTokenClassification": "mha.ZooGQAForTokenClassification",
        "AutoModelForQuestionAnswering": "mha.ZooGQAForQuestionAnswering",
    }
    assert config["model_type"] == "zoo_gqa"
    code = sorted(path.name for path in tmp_path.glob("*.py"))
    assert code == [
        "cache_zoo.py",
        "cards_zoo.py",
        "checkpoint_zoo.py",
        "chunked_zoo.py",
        "clients_zoo.py",
        "compat_zoo.py",
        "configuration_zoo.py",
        "cross_attention_zoo.py",
        "heads_zoo.py",
        "layers_zoo.py",
        "loss_zoo.py",
        "masks_zoo.py",
        "mha.py",
        "modeling_zoo.py",
        "positions_zoo.py",
        "seq2seq_zoo.py",
        "translator_zoo.py",
    ]
    for name in code:  # the copied code must not need the package itself
        assert "hf_attn_zoo" not in get_imports(tmp_path / name)


def test_base_model_checkpoint_has_the_same_auto_map(tmp_path):
    tiny_model("mqa").model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "mha.ZooMQAForCausalLM"
    )
    assert type(AutoModel.from_pretrained(tmp_path)).__name__ == "ZooMQAModel"


def test_auto_classes_for_every_variant():
    for variant in VARIANTS.values():
        config = AutoConfig.for_model(variant.model_type, hidden_size=32, num_hidden_layers=1, vocab_size=50)
        assert type(config) is variant.config_class
        assert type(AutoModel.from_config(config)) is variant.model_class
        assert type(AutoModelForCausalLM.from_config(config)) is variant.causal_lm_class
        assert set(variant.heads) == {
            "AutoModelForCausalLM",
            "AutoModelForSequenceClassification",
            "AutoModelForTokenClassification",
            "AutoModelForQuestionAnswering",
        }
        for auto_class, head in variant.heads.items():
            model = getattr(transformers, auto_class).from_config(config)
            assert type(model) is head and type(model.model) is variant.model_class
            # transformers picks the backend from the top-level class: a head supports what its base model does
            assert head._supports_sdpa == variant.model_class._supports_sdpa


REMOTE_LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["hf_attn_zoo"] = None  # any attempt to import the package now fails
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    HEADS = ("SequenceClassification", "TokenClassification", "QuestionAnswering")
    for folder in sys.argv[1:]:
        expected = torch.load(f"{folder}/expected.pt")
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        assert type(config).__name__ == expected["config_class"] and type(base).__name__ == expected["base_class"]
        with torch.no_grad():
            logits = model(expected["input_ids"], attention_mask=expected["attention_mask"]).logits
        assert torch.equal(logits, expected["logits"]), folder
        for head in HEADS:  # every task head loads from the causal LM's checkpoint too
            auto_class = getattr(transformers, f"AutoModelFor{head}")
            model = auto_class.from_pretrained(folder, trust_remote_code=True, num_labels=2)
            assert type(model).__name__ == expected["base_class"].replace("Model", f"For{head}")
        classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
            f"{folder}/classifier", trust_remote_code=True
        ).eval()
        with torch.no_grad():
            logits = classifier(expected["input_ids"], attention_mask=expected["attention_mask"]).logits
        assert torch.equal(logits, expected["classifier_logits"]), folder
        print("ok", folder)
    """
)


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.3"),
    reason="transformers < 5.3 copies only the loaded file's direct relative imports into its module cache, so remote "
    "code importing siblings two levels down (mha -> modeling_zoo -> loss_zoo) fails with FileNotFoundError",
)
def test_trust_remote_code_in_a_process_without_the_package(tmp_path):
    input_ids, attention_mask, _ = left_padded_batch()
    folders = []
    for case in CASES:
        name, position = case.values
        model = tiny_model(name, position)
        folder = tmp_path / f"{name}-{position}"
        model.save_pretrained(folder)
        classifier = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2).eval()
        classifier.save_pretrained(folder / "classifier")
        with torch.no_grad():
            logits = model(input_ids, attention_mask=attention_mask).logits
            classifier_logits = classifier(input_ids, attention_mask=attention_mask).logits
        torch.save(
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "logits": logits,
                "classifier_logits": classifier_logits,
                "config_class": type(model.config).__name__,
                "base_class": type(model.model).__name__,
            },
            folder / "expected.pt",
        )
        folders.append(str(folder))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_LOADER, *folders],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(folders)
