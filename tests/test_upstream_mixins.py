"""transformers' own common model tests against the zoo: the unmodified `ModelTesterMixin` + `GenerationTesterMixin`
with BART's `BartModelTester` sizes and inputs, over every zoo encoder-decoder (every variant's translator with
dot-product cross-attention, each other cross-attention kind, the RNN) and BART itself as the control (Marian and T5
too, through the same mixins with their own testers); and the same mixins with Llama's tester sizes and inputs
(`CausalLMTester`) over every zoo causal LM and its base model, Llama as the control.

The upstream files are not in the repository: `python -m tests.upstream_tests --snapshot PATH` assembles them (see
tests/upstream_tests.py); without them the module is skipped, naming what is missing. Every test a model is known to
fail is listed in `KNOWN_FAILURES` with its reason: such a test must fail (a fix makes it an error until its entry is
removed), any other failure fails the run. A run of the whole module rewrites the table in docs/testing.md.

    python -m tests.upstream_tests --snapshot PATH
    python -m pytest tests/test_upstream_mixins.py -m slow
"""

import contextlib
import fcntl
import functools
import inspect
import json
import re
import sys
import unittest
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from hf_attn_zoo.models import SEQ2SEQ, VARIANTS

from conftest import CONFORMANCE
from upstream_tests import COMMAND, cache_dir, missing

pytestmark = pytest.mark.slow

ABSENT = missing()
if ABSENT:
    pytest.skip(
        f"transformers {transformers.__version__}'s own tests are not assembled (missing: {', '.join(ABSENT)}); "
        f"get them with `{COMMAND}`",
        allow_module_level=True,
    )

# the assembled folder holds transformers' `tests` package, whose files import each other as `tests.<module>`; the
# repository's tests/ folder (no __init__.py) must not shadow it as a namespace package
sys.path.insert(0, str(cache_dir()))
if "tests" in sys.modules and getattr(sys.modules["tests"], "__file__", None) is None:
    del sys.modules["tests"]
from tests.generation.test_utils import GenerationTesterMixin  # noqa: E402
from tests.models.bart.test_modeling_bart import BartModelTester  # noqa: E402
from tests.models.marian.test_modeling_marian import MarianModelTester  # noqa: E402
from tests.models.t5.test_modeling_t5 import T5ModelTester  # noqa: E402
from tests.test_modeling_common import ModelTesterMixin, ids_tensor  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
TABLE_START, TABLE_END = "<!-- upstream-mixins:start -->", "<!-- upstream-mixins:end -->"

# the cross-attention kinds besides every variant's dot-product MHA one (as tests/test_seq2seq.py builds them)
CROSS_ATTENTION = {
    "gqa-cross_gqa": {"cross_attention_num_key_value_heads": 2},
    "mha-cross_mqa": {"cross_attention_num_key_value_heads": 1},
    "mha-cross_additive": {"cross_attention": "additive", "cross_attention_additive_dim": 6},
}


@dataclass(frozen=True)
class KnownFailure:
    """Tests some models fail, and why: `assumption` (what the test expects of every model, a different model cannot
    meet; a control confirms it where one exists) or `defect` (the zoo's to fix)."""

    kind: str
    reason: str
    tests: tuple[str, ...]  # test method names (those of a parameterized test, too)
    models: tuple[str, ...]  # case names (`gqa`, `mha-cross_additive`, `rnn`; `causal-gqa` for the causal LMs)


# why each failing test fails (keys name the causes; D1, D3 and D4, found by this module, are fixed)
REASONS = {
    "cross_heads": (
        "The test derives every cache layer's shape from the self-attention's fields (`num_key_value_heads`, "
        "`head_dim`, MLA's latent width), the cross-attention's layers included; the zoo's cross-attention "
        "has its own (`cross_attention_num_key_value_heads`, all heads by default; the additive one caches "
        "keys at `cross_attention_additive_dim`). `gqa-cross_gqa`, where the two agree, passes these tests."
    ),
    "state": (
        "The test reads per-token keys and values from every cache layer, or decodes from a `DynamicCache`; "
        "this variant decodes from a running state per layer (no key or value per token), and refuses a "
        "key/value cache naming why."
    ),
    "no_maps": (
        "The test expects attention maps of `num_attention_heads` heads over every key; AFT has no heads and "
        "no attention weights (it returns none), linear attention has no normalised map (phi(q)·phi(k) is "
        "never formed per pair: it returns none), Linformer's causal decoder has no map over the tokens (it "
        "compresses the keys anew at every step; it returns none), Mamba has no attention at all (a selective "
        "scan; it returns none), and the RNN translator has no "
        "self-attention (its config has no `num_attention_heads`, its outputs no maps)."
    ),
    "bigbird_maps": (
        "The test reads the gradient of the returned attention maps, so it expects them to be the tensor the output "
        "is computed from; BigBird computes its output from block-sparse probabilities over the gathered key tiles "
        "and returns them scattered into a dense (T, S) map for reading, which the output does not depend on (no "
        "gradient reaches it)."
    ),
    "linformer_maps": (
        "The test expects attention maps over every key; Linformer's are over its `linformer_k` compressed "
        "slots (5 here, 7 keys)."
    ),
    "window": (
        "The test expects a cache of every token; the sliding-window self-attention keeps only the last "
        "`sliding_window` - 1."
    ),
    "by_name": (
        "The test skips base models and adds labels by class name, from transformers' own Auto mappings "
        "(`MODEL_MAPPING_NAMES`, ...); a model registered at run time (`AutoModel.register`) is not in them, "
        "so the test trains the base model, which has no loss. BART and Llama pass it because `BartModel` and "
        "`LlamaModel` are listed. For the translators this hides D2 (gradient checkpointing with "
        "`use_reentrant=True`), which these tests would otherwise show."
    ),
    "additive_self": (
        "The test expects cached keys of `head_dim`; the additive variant caches its keys projected to "
        "`additive_dim` (8 here), what its scores read at every step."
    ),
    "rnn_layers": (
        "The test expects `num_hidden_layers` + 1 hidden states per side; the RNN translator's stacked "
        "`nn.GRU` runs its layers in one call and returns the embeddings and the top layer's output."
    ),
    "window_static": (
        "The test expects a static cache of `max_cache_len` slots in every layer and a quantized cache; "
        "transformers builds a sliding-window layer's static cache at `sliding_window` slots (4 here) and refuses "
        "`QuantizedCache` for sliding layers. Mistral with the same `sliding_window` fails these tests the same "
        "way."
    ),
    "quant_group": (
        "The test quantizes the cache in groups of 8 (`q_group_size`); MLA caches its latent at `kv_lora_rank` "
        "(12 in the tiny config, 7 tokens x 12 = 84 values, not a multiple of 8) where Llama caches heads of 16; "
        "with `kv_lora_rank=16`, `qk_rope_head_dim=8` MLA passes it."
    ),
}

KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    KnownFailure(
        "assumption",
        REASONS["additive_self"],
        (
            "test_assisted_decoding_matches_greedy_search_0_random",
            "test_assisted_decoding_matches_greedy_search_1_same",
            "test_assisted_decoding_sample",
            "test_beam_search_generate_dict_outputs_use_cache",
            "test_greedy_generate_dict_outputs_use_cache",
            "test_past_key_values_format",
        ),
        ("additive",),
    ),
    KnownFailure(
        "assumption",
        REASONS["by_name"],
        ("test_training",),
        (
            "additive",
            "aft_full",
            "aft_local",
            "aft_simple",
            "bigbird",
            "linear",
            "differential",
            "gqa",
            "gqa-cross_gqa",
            "linformer",
            "mha",
            "mha-cross_additive",
            "mha-cross_mqa",
            "mla",
            "mqa",
            "rnn",
            "single_head",
            "sliding_window",
            "topk",
        ),
    ),
    KnownFailure(
        "assumption",
        REASONS["by_name"],
        (
            "test_training_gradient_checkpointing",
            "test_training_gradient_checkpointing_use_reentrant_false",
            "test_training_gradient_checkpointing_use_reentrant_true",
        ),
        (
            "additive",
            "aft_full",
            "aft_local",
            "aft_simple",
            "bigbird",
            "linear",
            "differential",
            "gqa",
            "gqa-cross_gqa",
            "linformer",
            "mha",
            "mha-cross_additive",
            "mha-cross_mqa",
            "mla",
            "mqa",
            "single_head",
            "sliding_window",
            "topk",
        ),
    ),
    KnownFailure(
        "assumption",
        REASONS["no_maps"],
        ("test_attention_outputs",),
        ("aft_full", "aft_local", "aft_simple", "linear", "rnn"),
    ),
    KnownFailure(
        "assumption",
        REASONS["no_maps"],
        ("test_retain_grad_hidden_states_attentions",),
        ("aft_full", "aft_local", "aft_simple", "linear", "linformer", "rnn"),
    ),
    KnownFailure(
        "assumption",
        REASONS["no_maps"],
        (
            "test_beam_sample_generate_dict_output",
            "test_beam_search_generate_dict_output",
            "test_beam_search_generate_dict_outputs_use_cache",
            "test_greedy_generate_dict_outputs",
            "test_greedy_generate_dict_outputs_use_cache",
            "test_sample_generate_dict_output",
        ),
        ("rnn",),
    ),
    KnownFailure(
        "assumption",
        REASONS["state"],
        ("test_bc_cache_name_forward",),
        ("aft_full", "aft_local", "aft_simple", "linear", "linformer"),
    ),
    KnownFailure(
        "assumption",
        REASONS["state"],
        ("test_beam_search_generate_dict_outputs_use_cache", "test_greedy_generate_dict_outputs_use_cache"),
        ("aft_full", "aft_local", "aft_simple", "linear"),
    ),
    KnownFailure(
        "assumption",
        REASONS["state"],
        ("test_generate_continue_from_past_key_values", "test_past_key_values_format"),
        ("aft_full", "aft_local", "aft_simple", "linear", "linformer", "rnn"),
    ),
    KnownFailure(
        "assumption",
        REASONS["cross_heads"],
        (
            "test_assisted_decoding_matches_greedy_search_0_random",
            "test_assisted_decoding_matches_greedy_search_1_same",
            "test_assisted_decoding_sample",
            "test_past_key_values_format",
        ),
        ("bigbird", "differential", "gqa", "mha-cross_additive", "mha-cross_mqa", "mla", "mqa", "topk"),
    ),
    KnownFailure(
        "assumption",
        REASONS["cross_heads"],
        ("test_beam_search_generate_dict_outputs_use_cache", "test_greedy_generate_dict_outputs_use_cache"),
        (
            "bigbird",
            "differential",
            "gqa",
            "mha-cross_additive",
            "mha-cross_mqa",
            "mla",
            "mqa",
            "sliding_window",
            "topk",
        ),
    ),
    KnownFailure(
        "assumption",
        REASONS["bigbird_maps"],
        ("test_retain_grad_hidden_states_attentions",),
        ("bigbird", "causal-bigbird"),
    ),
    KnownFailure(
        "assumption",
        REASONS["cross_heads"],
        ("test_generate_compilation_all_outputs",),
        ("gqa", "mha-cross_additive", "mha-cross_mqa", "mla", "mqa", "sliding_window"),
    ),
    KnownFailure(
        "assumption",
        REASONS["linformer_maps"],
        (
            "test_attention_outputs",
            "test_beam_sample_generate_dict_output",
            "test_beam_search_generate_dict_output",
            "test_beam_search_generate_dict_outputs_use_cache",
            "test_greedy_generate_dict_outputs",
            "test_greedy_generate_dict_outputs_use_cache",
            "test_sample_generate_dict_output",
        ),
        ("linformer",),
    ),
    KnownFailure("assumption", REASONS["rnn_layers"], ("test_hidden_states_output",), ("rnn",)),
    KnownFailure(
        "assumption",
        REASONS["window"],
        (
            "test_assisted_decoding_matches_greedy_search_0_random",
            "test_assisted_decoding_matches_greedy_search_1_same",
            "test_assisted_decoding_sample",
            "test_past_key_values_format",
        ),
        ("sliding_window",),
    ),
    # the causal LMs (Llama's tester sizes; Llama fails nothing)
    KnownFailure(
        "assumption",
        REASONS["by_name"],
        (
            "test_training",
            "test_training_gradient_checkpointing",
            "test_training_gradient_checkpointing_use_reentrant_false",
            "test_training_gradient_checkpointing_use_reentrant_true",
        ),
        (
            "causal-additive",
            "causal-aft_full",
            "causal-aft_local",
            "causal-aft_simple",
            "causal-bigbird",
            "causal-linear",
            "causal-mamba",
            "causal-differential",
            "causal-gqa",
            "causal-linformer",
            "causal-mha",
            "causal-mla",
            "causal-mqa",
            "causal-single_head",
            "causal-sliding_window",
            "causal-topk",
        ),
    ),
    KnownFailure(
        "assumption",
        REASONS["no_maps"],
        ("test_attention_outputs", "test_retain_grad_hidden_states_attentions"),
        (
            "causal-aft_full",
            "causal-aft_local",
            "causal-aft_simple",
            "causal-linear",
            "causal-mamba",
            "causal-linformer",
        ),
    ),
    KnownFailure(
        "assumption",
        REASONS["state"],
        (
            "test_beam_search_generate_dict_outputs_use_cache",
            "test_generate_continue_from_inputs_embeds",
            "test_generate_continue_from_past_key_values",
            "test_generate_with_quant_cache",
            "test_greedy_generate_dict_outputs_use_cache",
            "test_past_key_values_format",
        ),
        (
            "causal-aft_full",
            "causal-aft_local",
            "causal-aft_simple",
            "causal-linear",
            "causal-mamba",
            "causal-linformer",
        ),
    ),
    KnownFailure(
        "assumption",
        REASONS["window"],
        (
            "test_assisted_decoding_matches_greedy_search_0_random",
            "test_assisted_decoding_matches_greedy_search_1_same",
            "test_assisted_decoding_sample",
            "test_beam_search_generate_dict_outputs_use_cache",
            "test_generate_compilation_all_outputs",
            "test_greedy_generate_dict_outputs_use_cache",
            "test_past_key_values_format",
        ),
        ("causal-sliding_window",),
    ),
    KnownFailure(
        "assumption",
        REASONS["window_static"],
        (
            "test_generate_from_inputs_embeds_with_static_cache",
            "test_generate_with_static_cache",
            "test_generate_with_quant_cache",
        ),
        ("causal-sliding_window",),
    ),
    KnownFailure("assumption", REASONS["quant_group"], ("test_generate_with_quant_cache",), ("causal-mla",)),
)


def known_failure(case: str, test: str) -> KnownFailure | None:
    for failure in KNOWN_FAILURES:
        # parameterized.expand names its tests `<name>_<index>[_<first parameter>]`
        if case in failure.models and any(re.fullmatch(rf"{name}(_\d+(_.*)?)?", test) for name in failure.tests):
            return failure
    return None


# ---------------------------------------------------------------------------------------------------------------------
# outcomes, recorded per (case, test) by the wrapper every test method runs in


OUTCOMES: dict[tuple[str, str], tuple[str, str]] = {}  # (case, test) -> (passed | skipped | failed, message)
EXPECTED: dict[str, list[str]] = {}  # case -> its test names


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return re.sub(r"\s+", " ", text[0] if text else type(error).__name__)[:200]


def record(case: str, test: str, method):
    """`method` run so that its outcome is recorded and checked against `KNOWN_FAILURES`; `subTest` blocks let
    their failures through (the first one fails the test) and keep their skips to themselves, as unittest does."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        @contextlib.contextmanager
        def sub_test(msg=None, **params):
            with contextlib.suppress(unittest.SkipTest):
                yield

        self.subTest = sub_test
        expected = known_failure(case, test)
        try:
            method(self, *args, **kwargs)
        except unittest.SkipTest as skip:
            OUTCOMES[case, test] = ("skipped", str(skip))
            if expected is not None:  # a listed test that no longer fails, as a fix can make it (the RNN's D4)
                pytest.fail(f"{test} now skips on {case} ({skip}): remove it from KNOWN_FAILURES ({expected.reason})")
            raise
        except Exception as error:
            OUTCOMES[case, test] = ("failed", first_line(error))
            if expected is not None:
                pytest.xfail(f"{expected.kind}: {expected.reason}")
            raise
        OUTCOMES[case, test] = ("passed", "")
        if expected is not None:
            pytest.fail(f"{test} now passes on {case}: remove it from KNOWN_FAILURES ({expected.reason})")

    return run


def bind(cls: type, case: str) -> type:
    """Wrap every test method of `cls` (inherited ones included) with `record`, on `cls` itself."""
    names = sorted(name for name, _ in inspect.getmembers(cls, inspect.isfunction) if name.startswith("test"))
    for name in names:
        setattr(cls, name, record(case, name, getattr(cls, name)))
    # those unittest skips without calling them (`@unittest.skip...` marks the method, `functools.wraps` copies the
    # mark onto the wrapper) get no outcome: the table counts the tests that run
    EXPECTED[case] = [name for name in names if not getattr(getattr(cls, name), "__unittest_skip__", False)]
    return cls


# ---------------------------------------------------------------------------------------------------------------------
# the encoder-decoders: BART's tester, the config of each case


def seq2seq_config(case: str, tester: BartModelTester):
    """The config of `case` at BART's tester sizes: width, layers, feed-forward width, positions and special tokens as
    `BartModelTester.get_config` sets them on BART, and the variant's own fields (tests/conftest.py), its heads among
    them: BART's 4 where the variant has heads, 1 for single-head attention and AFT (which has none)."""
    if case == "bart":
        return BartModelTester.get_config(tester)
    sizes = dict(
        vocab_size=tester.vocab_size,
        hidden_size=tester.hidden_size,
        eos_token_id=tester.eos_token_id,
        bos_token_id=tester.bos_token_id,
        pad_token_id=tester.pad_token_id,
        decoder_start_token_id=transformers.BartConfig().decoder_start_token_id,
    )
    if case == "rnn":
        return SEQ2SEQ["rnn"].config(**sizes, num_layers=tester.num_hidden_layers, dropout=tester.hidden_dropout_prob)
    name = case.split("-")[0]
    fields = dict(
        sizes,
        num_hidden_layers=tester.num_hidden_layers,
        encoder_layers=tester.num_hidden_layers,
        decoder_layers=tester.num_hidden_layers,
        intermediate_size=tester.intermediate_size,
        max_position_embeddings=tester.max_position_embeddings,
        attention_dropout=tester.attention_probs_dropout_prob,
    )
    fields |= CONFORMANCE[name]["config"] | CROSS_ATTENTION.get(case, {})
    return SEQ2SEQ[name].config(**fields)


def seq2seq_case(case: str) -> type:
    classes = (
        (transformers.BartModel, transformers.BartForConditionalGeneration)
        if case == "bart"
        else (SEQ2SEQ[case.split("-")[0]].model_class, SEQ2SEQ[case.split("-")[0]].generation_class)
    )

    class Tester(BartModelTester):
        def get_config(self):
            config = seq2seq_config(case, self)
            # the tests read the heads off the tester too: the variant's own (1 for single-head attention and AFT)
            self.num_attention_heads = getattr(config, "num_attention_heads", self.num_attention_heads)
            return config

    class Case(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
        all_model_classes = classes
        pipeline_model_mapping = {}
        is_encoder_decoder = True

        def setUp(self):
            self.model_tester = Tester(self)

    Case.__name__ = Case.__qualname__ = f"TestSeq2Seq_{case.replace('-', '_')}"
    return bind(Case, case)


SEQ2SEQ_CASES = ["bart", *(name for name in SEQ2SEQ if name != "rnn"), *CROSS_ATTENTION, "rnn"]
for _case in SEQ2SEQ_CASES:
    _cls = seq2seq_case(_case)
    globals()[_cls.__name__] = _cls


def native_control(
    case: str, tester: type, classes: tuple[type, ...], skips: dict[str, str] | None = None, **flags
) -> type:
    """Another native encoder-decoder through the same unmodified mixins, with its own upstream tester and what its
    upstream test class sets (Marian: no missing-keys check; T5: resizable embeddings, its split percentages, and
    the test it skips): the mixins, not the zoo, are what a control of this run checks."""

    class Case(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
        all_model_classes = classes
        pipeline_model_mapping = {}
        is_encoder_decoder = True

        def setUp(self):
            self.model_tester = tester(self)

    for name, value in flags.items():
        setattr(Case, name, value)
    for name, reason in (skips or {}).items():
        setattr(Case, name, unittest.skip(reason)(getattr(Case, name)))
    Case.__name__ = Case.__qualname__ = f"TestSeq2Seq_{case}"
    return bind(Case, case)


TestSeq2Seq_marian = native_control(
    "marian", MarianModelTester, (transformers.MarianModel, transformers.MarianMTModel), test_missing_keys=False
)
TestSeq2Seq_t5 = native_control(
    "t5",
    T5ModelTester,
    (transformers.T5Model, transformers.T5ForConditionalGeneration),
    skips={"test_model_base_model_prefix": "T5 has no separate base model without a head (T5ModelTest skips it)."},
    test_resize_embeddings=True,
    model_split_percents=[0.5, 0.8, 0.9],
)
SEQ2SEQ_CASES = ["bart", "marian", "t5", *SEQ2SEQ_CASES[1:]]


# ---------------------------------------------------------------------------------------------------------------------
# the causal LMs: Llama's tester sizes and inputs, the variant's own fields on top
#
# The snapshot's `CausalLMModelTester` reads its sizes from `transformers.testing_utils._TEXT_MODEL_TESTER_DEFAULTS`,
# which the installed release lacks, so it cannot be imported against it; `CausalLMTester` prepares what it prepares
# for `LlamaModelTester` (the sizes of that table, the lower-triangular attention mask, the labels) and the cases run
# the same unmodified `ModelTesterMixin` + `GenerationTesterMixin` as the encoder-decoders.


class CausalLMTester:
    """Llama's tester sizes (`LlamaModelTester`, through `CausalLMModelTester`'s defaults) for any causal LM: batch 13
    of 7 tokens from a vocabulary of 99, 2 layers of width 32 with 2 heads and 2 key/value heads, a feed-forward
    width of 32; the config is `config(**sizes)`, so a variant's own fields (its heads among them) replace these."""

    batch_size, seq_length, vocab_size = 13, 7, 99
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 32, 2, 2, 2
    intermediate_size, hidden_act, max_position_embeddings = 32, "gelu", 512
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    hidden_dropout_prob = attention_probs_dropout_prob = 0.1
    type_sequence_label_size, num_labels, num_choices = 2, 3, 4
    is_training, use_input_mask, use_labels = True, True, True

    def __init__(self, parent: unittest.TestCase, config) -> None:
        self.parent = parent
        self.config = config  # a callable: the sizes -> the config
        probe = self.get_config()
        # the tests read the heads and head width off the tester too: the model's own (1 for AFT, which has none)
        self.num_attention_heads = getattr(probe, "num_attention_heads", None) or 1
        self.num_key_value_heads = getattr(probe, "num_key_value_heads", None) or self.num_attention_heads
        self.head_dim = getattr(probe, "head_dim", None) or self.hidden_size // self.num_attention_heads

    def get_config(self):
        return self.config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            tie_word_embeddings=False,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        # row i attends to its first i + 1 tokens (right padding of every length), as CausalLMModelTester masks
        attention_mask = torch.tril(torch.ones_like(input_ids))
        sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
        choice_labels = ids_tensor([self.batch_size], self.num_choices)
        return self.get_config(), input_ids, attention_mask, sequence_labels, token_labels, choice_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def create_and_check_model(self, base_model_class, config, input_ids, attention_mask, *_) -> None:
        model = base_model_class(config).eval()
        model(input_ids, attention_mask=attention_mask)
        result = model(input_ids)
        expected = (self.batch_size, self.seq_length, self.hidden_size)
        self.parent.assertEqual(result.last_hidden_state.shape, expected)


def causal_lm_case(case: str) -> type:
    if case == "causal-llama":
        classes, make_config = (transformers.LlamaModel, transformers.LlamaForCausalLM), transformers.LlamaConfig
    else:
        variant = VARIANTS[case.removeprefix("causal-")]
        classes = (variant.model_class, variant.causal_lm_class)

        def make_config(**sizes):
            # the variant's own fields (tests/conftest.py) over Llama's sizes
            # the heads are the variant's (its defaults where it sets none: one for single-head attention and AFT)
            heads = ("num_attention_heads", "num_key_value_heads")
            fields = {name: value for name, value in sizes.items() if name not in heads}
            fields |= CONFORMANCE[variant.name]["config"]
            accepted = inspect.signature(variant.config_class.__init__).parameters
            if "kwargs" not in accepted:
                fields = {name: value for name, value in fields.items() if name in accepted}
            return variant.config(**fields)

    class Case(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
        all_model_classes = classes
        pipeline_model_mapping = {}

        def setUp(self):
            self.model_tester = CausalLMTester(self, make_config)

        def test_model(self):
            self.model_tester.create_and_check_model(classes[0], *self.model_tester.prepare_config_and_inputs())

    Case.__name__ = Case.__qualname__ = f"TestCausalLM_{case.removeprefix('causal-')}"
    return bind(Case, case)


CAUSAL_LM_CASES = ["causal-llama", *(f"causal-{name}" for name in VARIANTS)]
for _case in CAUSAL_LM_CASES:
    _cls = causal_lm_case(_case)
    globals()[_cls.__name__] = _cls


# ---------------------------------------------------------------------------------------------------------------------
# the table in docs/testing.md


def table(outcomes: dict[tuple[str, str], tuple[str, str]]) -> str:
    """Per case: passed / skipped / failed, then every failure with its reason (`KNOWN_FAILURES`) or, for one not
    listed, its error."""
    cases = [case for case in [*SEQ2SEQ_CASES, *CAUSAL_LM_CASES] if any(c == case for c, _ in outcomes)]
    lines = ["| model | passed | skipped | failed |", "| --- | --- | --- | --- |"]
    for case in cases:
        counts = [sum(1 for (c, _), (o, _) in outcomes.items() if c == case and o == kind) for kind in OUTCOME_KINDS]
        lines.append(f"| `{case}` | " + " | ".join(map(str, counts)) + " |")
    lines += ["", "| test | models | kind | reason |", "| --- | --- | --- | --- |"]
    failed: dict[tuple[str, str, str], list[str]] = {}
    for (case, test), (outcome, message) in sorted(outcomes.items()):
        if outcome == "failed":
            known = known_failure(case, test)
            key = (test, known.kind, known.reason) if known else (test, "new", message.replace("|", "\\|"))
            failed.setdefault(key, []).append(case)
    for (test, kind, reason), cases_failing in sorted(failed.items()):
        lines.append(f"| `{test}` | {', '.join(f'`{c}`' for c in cases_failing)} | {kind} | {reason} |")
    return "\n".join(lines)


OUTCOME_KINDS = ("passed", "skipped", "failed")


def write_table(outcomes: dict[tuple[str, str], tuple[str, str]]) -> None:
    text = DOC.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    DOC.write_text(text[:start] + "\n" + table(outcomes) + "\n" + text[end:])


def saved_outcomes() -> dict[tuple[str, str], tuple[str, str]]:
    path = cache_dir() / "outcomes.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {tuple(key.split("::", 1)): tuple(value) for key, value in saved.items()}


@pytest.fixture(scope="module", autouse=True)
def rewrite_table():
    """After the module's tests, their outcomes into `outcomes.json` beside the upstream files (over those of earlier
    runs: the module can run in parts, `-k TestSeq2Seq_gqa`), and once every test has an outcome there, the table in
    docs/testing.md."""
    yield
    with open(cache_dir() / "outcomes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parts running side by side
        outcomes = saved_outcomes() | OUTCOMES
        saved = {f"{case}::{test}": list(outcome) for (case, test), outcome in sorted(outcomes.items())}
        (cache_dir() / "outcomes.json").write_text(json.dumps(saved, indent=1) + "\n")
    expected = {(case, test) for case, tests in EXPECTED.items() for test in tests}
    if expected <= outcomes.keys():
        write_table({key: outcomes[key] for key in expected})


if __name__ == "__main__":  # the table again from the last run's outcomes (after editing KNOWN_FAILURES)
    write_table(saved_outcomes())
