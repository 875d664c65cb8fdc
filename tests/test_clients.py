"""Clients that transformers users bring, run for real on every variant: TRL's packing and padding-free training, and
the native conventions other clients read (the rotary module's output, the attention's keyword call).

TRL's padding-free batch is one flattened row: `position_ids` restarting at 0 at every document, `cu_seq_lens_*`,
`max_length_*` and `seq_idx`, no attention mask, no cache. transformers' rule for such a row (position ids that
restart mark document boundaries) must make every packed document see only itself, exactly as if it ran alone.
"""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_attn_zoo.convert.llama import LLAMA_BACKBONE, to_llama
from hf_attn_zoo.data import byte_level_tokenizer
from hf_attn_zoo.models import VARIANTS

from conftest import ATOL, CACHE_KWARG, CASES, CONFORMANCE, VOCAB_SIZE, tiny_model

trl = pytest.importorskip("trl", reason='TRL is not installed (pip install -e ".[trl]" in a clone of hf_attn_zoo)')

NAMES = [name for name in VARIANTS if name in CONFORMANCE]
# lengths around the tiny configs' chunk (4), window (4, banded beyond 8) and Linformer slots (5)
DOCUMENT_LENGTHS = (13, 9, 20, 3)


def documents(lengths=DOCUMENT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def split_documents(batch: dict) -> list[torch.Tensor]:
    """The documents of a padding-free row, cut where its position ids restart."""
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    return list(torch.tensor_split(batch["input_ids"][0], starts[1:]))


def assert_packed_row_is_its_documents(model, batch: dict) -> None:
    """Each packed document's logits equal the document run alone, and the packed loss is the token-weighted mean of
    the documents' own losses (TRL masks the label at each document's first token, so no document predicts across
    a boundary)."""
    model.eval()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        packed = model(**inputs, labels=batch["labels"], use_cache=False)
        start, loss_sum, counted = 0, 0.0, 0
        for document in split_documents(batch):
            alone = model(document[None], labels=document[None], use_cache=False)
            end = start + len(document)
            torch.testing.assert_close(packed.logits[0, start:end], alone.logits[0], atol=ATOL, rtol=0)
            loss_sum, counted = loss_sum + alone.loss * (len(document) - 1), counted + len(document) - 1
            start = end
    torch.testing.assert_close(packed.loss, loss_sum / counted, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name,position", CASES)
def test_trl_padding_free_batch_gives_each_document_its_own_result(name, position):
    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator([{"input_ids": document} for document in documents()])
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch and "cu_seq_lens_q" in batch
    assert_packed_row_is_its_documents(tiny_model(name, position), batch)


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
@pytest.mark.parametrize("name", NAMES)
def test_sft_trainer_trains_on_packed_documents(name, mode, tmp_path, works_with):
    """A real `SFTTrainer` step with `packing=True` (TRL's best-fit packing) or `padding_free=True`: the batch the
    model received is checked document by document, and the step changed the weights."""
    from datasets import Dataset

    tokenizer = byte_level_tokenizer()
    model = tiny_model(name, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    received = []
    model.register_forward_pre_hook(lambda module, args, kwargs: received.append(dict(kwargs)), with_kwargs=True)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        packing=mode == "packing",
        padding_free=mode == "padding_free",
        max_length=32 if mode == "packing" else None,  # TRL does not truncate padding-free rows
        per_device_train_batch_size=3,
        max_steps=1,
        learning_rate=1e-3,
        bf16=False,  # TRL defaults to bf16; the documents are compared in float32
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"input_ids": documents(lengths=(13, 9, 20, 7, 5, 11))})
    trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()

    (batch,) = received
    assert batch["use_cache"] is False and "attention_mask" not in batch
    assert len(split_documents(batch)) > 1, "the batch packs several documents into one row"
    assert any(not torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert_packed_row_is_its_documents(model, {key: batch[key] for key in ("input_ids", "position_ids", "labels")})
    if mode == "packing":
        works_with("trl", name)


@pytest.mark.parametrize("name", ["gqa", "sliding_window", "differential"])
def test_rotary_module_returns_what_llamas_returns(name):
    """Clients such as kvpress rebuild rotated queries from `model.model.rotary_emb` with transformers'
    `apply_rotary_pos_emb`; they need Llama's `(cos, sin)`."""
    model = tiny_model(name)
    llama_config = to_llama(tiny_model("gqa", **LLAMA_BACKBONE)).config  # Llama's config of the same size
    llama_config.rope_parameters = model.config.rope_parameters
    llama_config.head_dim = model.model.attention_class.rotary_dim(model.config)
    positions = torch.tensor([[0, 1, 2, 7, 30]])
    hidden = torch.zeros(1, 5, model.config.hidden_size)
    llamas = LlamaRotaryEmbedding(llama_config)(hidden, positions)
    for ours, theirs in zip(model.model.rotary_emb(hidden, positions), llamas):
        assert torch.equal(ours, theirs)


def test_decoder_layer_calls_attention_with_keywords_as_llama_does():
    """Forward hooks registered `with_kwargs` (kvpress's mechanism) find `hidden_states` by name, in the zoo as in
    Llama."""
    zoo = tiny_model("gqa", **LLAMA_BACKBONE)
    for model in (zoo, to_llama(zoo)):
        seen = []

        def hook(module, args, kwargs, output, seen=seen):
            seen.append((args, kwargs))

        model.model.layers[0].self_attn.register_forward_hook(hook, with_kwargs=True)
        model(torch.tensor([[5, 6, 7]]))
        ((args, kwargs),) = seen
        assert args == () and kwargs["hidden_states"].shape == (1, 3, zoo.config.hidden_size), type(model).__name__
        assert set(kwargs) >= {"position_embeddings", "attention_mask", CACHE_KWARG}  # as this release names it
