"""Hub round trips with the real huggingface_hub client against a local stand-in (tests/hub_server.py): push_to_hub
of models and tokenizers, loading with the package and, in a process without it, as remote code; model cards;
revisions and branches; `hf-attn-zoo push`; errors for what is not there."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hub_server import HubServer, use_hub
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import RepositoryNotFoundError
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_attn_zoo.cards import model_card
from hf_attn_zoo.data import byte_level_tokenizer, tokenizer_fields
from hf_attn_zoo.hub import push_checkpoint
from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo_cli import main

from conftest import CONFORMANCE

TEXTS = ["def push(repo):", "return the url"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubServer(tmp_path / "hub-storage") as server:
        use_hub(monkeypatch, server.endpoint, tmp_path / "hf-home")
        yield server
    assert not server.not_served, f"client calls the test hub does not serve: {server.not_served}"


def byte_model(name: str, seed: int = 0):
    tokenizer = byte_level_tokenizer()
    config = VARIANTS[name].config(
        **tokenizer_fields(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        max_position_embeddings=64,
        **CONFORMANCE[name]["config"],
    )
    torch.manual_seed(seed)
    return VARIANTS[name].causal_lm_class(config).eval(), tokenizer


def logits_of(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


def test_push_model_and_tokenizer_then_load_with_the_package(hub):
    model, tokenizer = byte_model("gqa")
    model.push_to_hub("zoo/gqa-tiny")
    tokenizer.push_to_hub("zoo/gqa-tiny")

    files = {sibling.rfilename for sibling in HfApi().model_info("zoo/gqa-tiny").siblings}
    assert {"config.json", "model.safetensors", "modeling_zoo.py", "tokenizer.json", "README.md"} <= files
    loaded = AutoModelForCausalLM.from_pretrained("zoo/gqa-tiny").eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained("zoo/gqa-tiny")
    assert type(loaded) is type(model)  # the package's class: no remote code without trust_remote_code
    assert loaded_tokenizer(TEXTS).input_ids == tokenizer(TEXTS).input_ids
    assert torch.equal(logits_of(loaded, loaded_tokenizer), logits_of(model, tokenizer))


REMOTE_LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["hf_attn_zoo"] = None  # any attempt to import the package now fails
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo, expected_file = sys.argv[1:]
    expected = torch.load(expected_file)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)  # it reads config.json, which names code
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    batch = tokenizer(expected["texts"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.equal(batch.input_ids, expected["input_ids"])
    assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
    print("ok", type(model).__name__)
    """
)


@pytest.mark.parametrize("name", ["gqa", "sliding_window", "aft_simple"])
def test_trust_remote_code_from_the_hub_in_a_process_without_the_package(hub, tmp_path, name):
    model, tokenizer = byte_model(name)
    repo = f"zoo/{name}-tiny"
    model.push_to_hub(repo)
    tokenizer.push_to_hub(repo)
    expected = tmp_path / "expected.pt"
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    torch.save({"texts": TEXTS, "input_ids": batch.input_ids, "logits": logits_of(model, tokenizer)}, expected)
    # the environment use_hub set: endpoint, token, fresh caches, not offline
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_LOADER, repo, str(expected)],
        capture_output=True,
        stdin=subprocess.DEVNULL,  # were transformers to ask whether to run remote code, it gets no answer
        text=True,
        env=dict(os.environ),
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"ok {type(model).__name__}")


def test_pushed_repo_carries_the_model_card(hub):
    model, tokenizer = byte_model("sliding_window")
    model.push_to_hub("zoo/card", tags=["my-tag"])
    tokenizer.push_to_hub("zoo/card")  # loads the repo's card and uploads it again: it must stay the zoo card

    card = ModelCard.load("zoo/card")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    for tag in ("hf-attn-zoo", "sliding_window", "zoo_sliding_window", "arxiv:2310.06825", "my-tag"):
        assert tag in card.data.tags, tag
    assert "Mistral 7B" in card.text and 'from_pretrained("zoo/card", trust_remote_code=True)' in card.text
    info = HfApi().model_info("zoo/card")  # the server reads the metadata as the Hub does
    assert info.pipeline_tag == "text-generation" and "hf-attn-zoo" in info.tags


def test_save_pretrained_writes_a_card_and_keeps_an_existing_one(tmp_path):
    model, _ = byte_model("aft_simple")
    model.save_pretrained(tmp_path / "plain")
    metadata = ModelCard.load(tmp_path / "plain" / "README.md").data
    assert "aft_simple" in metadata.tags and "arxiv:2105.14103" in metadata.tags
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "README.md").write_text("# my own card\n")
    model.save_pretrained(tmp_path / "kept")
    assert (tmp_path / "kept" / "README.md").read_text() == "# my own card\n"


def test_card_metadata_names_the_data_and_the_perplexity():
    model, _ = byte_model("topk")
    training = {"data": "Python standard-library sources", "dataset": "org/corpus", "validation_perplexity": 79.5}
    data = ModelCard(model_card(model.config, training, repo_id="zoo/topk")).data
    assert data.datasets == ["org/corpus"] and "arxiv:2106.06899" in data.tags
    [result] = data.eval_results
    assert (result.dataset_type, result.metric_type, result.metric_value) == ("org/corpus", "perplexity", 79.5)
    assert model_card(model.config).startswith("---\nlibrary_name: transformers\n")  # the old call still works


def test_a_second_push_is_a_new_revision_and_the_old_sha_still_loads(hub):
    api = HfApi()
    first, tokenizer = byte_model("gqa", seed=0)
    first.push_to_hub("zoo/history")
    first_sha = api.model_info("zoo/history").sha
    second, _ = byte_model("gqa", seed=1)
    second.push_to_hub("zoo/history")
    assert api.model_info("zoo/history").sha != first_sha

    latest = AutoModelForCausalLM.from_pretrained("zoo/history").eval()
    old = AutoModelForCausalLM.from_pretrained("zoo/history", revision=first_sha).eval()
    assert torch.equal(logits_of(latest, tokenizer), logits_of(second, tokenizer))
    assert torch.equal(logits_of(old, tokenizer), logits_of(first, tokenizer))

    third, _ = byte_model("gqa", seed=2)
    third.push_to_hub("zoo/history", revision="experiment")  # a branch, created from main
    on_branch = AutoModelForCausalLM.from_pretrained("zoo/history", revision="experiment").eval()
    assert torch.equal(logits_of(on_branch, tokenizer), logits_of(third, tokenizer))
    main_again = AutoModelForCausalLM.from_pretrained("zoo/history", revision="main").eval()
    assert torch.equal(logits_of(main_again, tokenizer), logits_of(second, tokenizer))


def test_cli_push_uploads_a_checkpoint_folder(hub, tmp_path, capsys):
    model, tokenizer = byte_model("gqa")
    folder = tmp_path / "checkpoint-40"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").unlink()  # a card is made from the training summary
    (folder / "training_summary.json").write_text(json.dumps({"validation_perplexity": 79.5, "steps": 40}))
    (folder / "optimizer.pt").write_bytes(b"resume-only state")
    (folder / "trainer_state.json").write_text("{}")

    assert main(["push", str(folder), "zoo/cli", "--revision", "v1", "--private"]) == 0
    assert capsys.readouterr().out.strip() == f"{hub.endpoint}/zoo/cli/tree/v1"

    info = HfApi().model_info("zoo/cli", revision="v1")
    files = {sibling.rfilename for sibling in info.siblings}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training_summary.json"} <= files
    assert not files & {"optimizer.pt", "trainer_state.json"} and info.private
    assert "README.md" not in {s.rfilename for s in HfApi().model_info("zoo/cli").siblings}  # main is untouched
    [result] = info.card_data.eval_results
    assert (result.metric_type, result.metric_value) == ("perplexity", 79.5)
    loaded = AutoModelForCausalLM.from_pretrained("zoo/cli", revision="v1").eval()
    assert torch.equal(logits_of(loaded, tokenizer), logits_of(model, tokenizer))

    # a second push of the same folder to main: the repo exists, the card written the first time goes up as it is
    assert push_checkpoint(folder, "zoo/cli") == f"{hub.endpoint}/zoo/cli"
    assert "README.md" in {s.rfilename for s in HfApi().model_info("zoo/cli").siblings}


def test_what_is_not_there_fails_clearly(hub, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("zoo/missing")
    with pytest.raises(OSError, match="zoo/missing"):
        AutoModelForCausalLM.from_pretrained("zoo/missing")
    model, _ = byte_model("mqa")
    model.push_to_hub("zoo/present")
    with pytest.raises(OSError, match="no-such-branch"):
        AutoModelForCausalLM.from_pretrained("zoo/present", revision="no-such-branch")
    with pytest.raises(FileNotFoundError, match="not a loadable model folder: no config.json"):
        push_checkpoint(tmp_path, "zoo/present")
