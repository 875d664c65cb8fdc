"""Shared fixtures of the test suite: tiny configs for every registered variant and padded batches."""

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from hf_attn_zoo.models import VARIANTS
from hf_attn_zoo.models.compat_zoo import CACHE_KWARG, returned_cache  # noqa: F401 (the tests import them from here)

import references

# The suite loads dozens of small text files through `datasets`, whose map() writes its cache files beside each
# loaded file's cache in ~/.cache/huggingface/datasets: run after run they pile up there (tens of GB over many runs).
# One temporary cache for the session (subprocesses inherit it) keeps the user's cache as it was.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="hf-attn-zoo-test-datasets-")
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
if "datasets" in sys.modules:  # imported already (by a plugin or the package): it read the variable at import
    sys.modules["datasets"].config.HF_DATASETS_CACHE = Path(_DATASETS_CACHE)

# `python3 dev.py test` runs the suite in pytest-xdist workers, one per core. Each worker takes its share of the
# cores as threads (its subprocesses inherit it) unless the run set OMP_NUM_THREADS: every worker at every core
# oversubscribes them, and OpenMP threads waiting on each other cost far more than the share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

VOCAB_SIZE = 97

# Two different kernels or shapes computing the same function in float32 (chunked vs dense, cached vs uncached,
# GQA vs the MHA it was pooled from) round differently, and the rounding depends on the CPU and the thread count:
# measured differences reach a few 1e-6. Such comparisons use this tolerance. Exact equality (`torch.equal`) is
# kept for computations that are bit-identical by construction: the same code on the same shapes (reloaded weights,
# a later token changed, a recomputed checkpointed layer), and for token ids.
ATOL = 1e-5

# Every registered variant needs an entry: its tiny config, the configs it must refuse (kwargs, field named in the
# error) and its naive reference attention. `test_every_variant_is_covered` fails when a variant has none. Everything
# else the suite needs to know (backends, whether it has attention weights and whether they sum to one, whether it
# decodes from a state) it reads off the variant's attention class.
CONFORMANCE = {
    "mha": {
        "config": dict(num_attention_heads=4),
        "invalid": [(dict(num_attention_heads=4, num_key_value_heads=2), "num_key_value_heads")],
        "reference": references.softmax_attention,
    },
    "gqa": {
        "config": dict(num_attention_heads=4, num_key_value_heads=2),
        "invalid": [(dict(num_attention_heads=6, num_key_value_heads=4, hidden_size=48), "num_key_value_heads")],
        "reference": references.softmax_attention,
    },
    "mqa": {
        "config": dict(num_attention_heads=4),
        "invalid": [(dict(num_attention_heads=4, num_key_value_heads=2), "num_key_value_heads")],
        "reference": references.softmax_attention,
    },
    "single_head": {
        "config": dict(),
        "invalid": [(dict(num_attention_heads=2), "num_attention_heads")],
        "reference": references.softmax_attention,
    },
}

CONFORMANCE["sliding_window"] = {
    # a window of 4 over 11-13 tokens: the window bites, and whole sequences (> 2w) take the banded kernel
    "config": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=4),
    "invalid": [(dict(sliding_window=0), "sliding_window"), (dict(sliding_window=2.5), "sliding_window")],
    "reference": references.softmax_attention,
}

CONFORMANCE["topk"] = {
    # keep 3 of up to 13 visible keys: the selection bites; chunks of 4 queries
    "config": dict(num_attention_heads=4, num_key_value_heads=2, topk=3, query_chunk_size=4),
    "invalid": [
        (dict(topk=0), "topk"),
        (dict(topk=65, max_position_embeddings=64), "topk"),
        (dict(query_chunk_size=0), "query_chunk_size"),
    ],
    "reference": references.topk_attention,
}
CONFORMANCE["additive"] = {
    "config": dict(num_attention_heads=4, additive_dim=8, query_chunk_size=4),
    "invalid": [(dict(additive_dim=0), "additive_dim"), (dict(query_chunk_size=-1), "query_chunk_size")],
    "reference": references.additive_attention,
}

CONFORMANCE["linformer"] = {
    # 5 slots, chunks of 4 tokens: prefix sums inside chunks and the running state across them both matter
    "config": dict(num_attention_heads=4, num_key_value_heads=2, linformer_k=5, query_chunk_size=4),
    "invalid": [
        (dict(linformer_k=0), "linformer_k"),
        (dict(linformer_k=65, max_position_embeddings=64), "linformer_k"),
        (dict(linformer_sharing="columnwise"), "linformer_sharing"),
    ],
    "reference": references.linformer_attention,
}
CONFORMANCE["aft_full"] = {
    "config": dict(aft_bias_rank=4, query_chunk_size=4),
    "invalid": [(dict(aft_bias_rank=0), "aft_bias_rank"), (dict(num_attention_heads=4), "num_attention_heads")],
    "reference": references.aft_attention,
}
CONFORMANCE["aft_local"] = {
    # a window of 3 positions inside chunks of 4: window keys carried across chunks and folded into the sums
    "config": dict(aft_bias_rank=4, aft_window=3, query_chunk_size=4),
    "invalid": [(dict(aft_window=0), "aft_window"), (dict(aft_window=65, max_position_embeddings=64), "aft_window")],
    "reference": references.aft_attention,
}
CONFORMANCE["aft_simple"] = {
    "config": dict(query_chunk_size=4),
    "invalid": [(dict(query_chunk_size=0), "query_chunk_size"), (dict(num_key_value_heads=2), "num_key_value_heads")],
    "reference": references.aft_attention,
}

CONFORMANCE["differential"] = {
    # 4 heads of two 4-wide maps reading 2 key/value heads: both maps, the grouping and λ all bite
    "config": dict(num_attention_heads=4, num_key_value_heads=2),
    "invalid": [
        (dict(hidden_size=48, num_attention_heads=5), "hidden_size"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    ],
    "reference": references.differential_attention,
}

CONFORMANCE["mla"] = {
    # 4 heads reading one 12-wide latent, RoPE on 4 of each query's 12 channels, queries through a bottleneck of 16
    "config": dict(num_attention_heads=4, kv_lora_rank=12, q_lora_rank=16),
    "invalid": [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(qk_rope_head_dim=3), "qk_rope_head_dim"),
        (dict(qk_nope_head_dim=-1), "qk_nope_head_dim"),
        (dict(rope_frequencies=[[0]]), "rope_frequencies"),
    ],
    "reference": references.latent_attention,
}

CONFORMANCE["linear"] = {
    # 4 heads reading 2 key/value heads' sums, chunks of 4 tokens: the running sums across chunks and the exact
    # products inside them both matter
    "config": dict(num_attention_heads=4, num_key_value_heads=2, query_chunk_size=4),
    "invalid": [
        (dict(linear_attention_eps=0.0), "linear_attention_eps"),
        (dict(query_chunk_size=0), "query_chunk_size"),
        (dict(position_embedding_type="rope"), "position_embedding_type"),
    ],
    "reference": references.linear_attention,
}

CONFORMANCE["bigbird"] = {
    # blocks of 2 positions: a window of 3 blocks, 2 global blocks and 1 random block; over 16 tokens (8 blocks) each
    # later block skips some earlier ones, and the causal cut inside a block matters
    "config": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_block_size=2,
        num_window_blocks=3,
        num_global_blocks=2,
        num_random_blocks=1,
    ),
    "invalid": [
        (dict(attention_block_size=0), "attention_block_size"),
        (dict(num_window_blocks=0), "num_window_blocks"),
        (dict(num_window_blocks=2, is_encoder_decoder=True), "num_window_blocks"),
        (dict(num_global_blocks=-1), "num_global_blocks"),
        (dict(num_random_blocks=1.5), "num_random_blocks"),
        (dict(random_blocks_seed=-3), "random_blocks_seed"),
    ],
    "reference": references.bigbird_attention,
}

CONFORMANCE["mamba"] = {
    # the mixer 64 wide (intermediate_size=64 below), 8 states, a kernel of 4 and chunks of 4 tokens: the carried
    # state across chunks, the decays inside them and the convolution's window across a chunked prefill all matter
    "config": dict(state_size=8, scan_chunk_size=4),
    "invalid": [
        (dict(state_size=0), "state_size"),
        (dict(conv_kernel=0), "conv_kernel"),
        (dict(scan_chunk_size=0), "scan_chunk_size"),
        (dict(mlp_type="gated"), "mlp_type"),
        (dict(time_step_min=0.2, time_step_max=0.1), "time_step_min"),
        (dict(is_encoder_decoder=True), "is_encoder_decoder"),
        (dict(is_decoder=False), "is_decoder"),
    ],
    "reference": references.mamba_mixer,
}

CASES = [
    pytest.param(name, position, id=f"{name}-{position}")
    for name, variant in VARIANTS.items()
    for position in variant.position_types
    if name in CONFORMANCE
]
# the cases whose variant can also run on transformers' sdpa kernel
SDPA_CASES = [case for case in CASES if VARIANTS[case.values[0]].causal_lm_class._supports_sdpa]


def tiny_config(name: str, position_embedding_type: str | None = None, **overrides):
    """A 2-layer, 32-wide config of variant `name` (with its own default position type unless one is given); large
    init so greedy choices are far from ties."""
    if position_embedding_type is not None:
        overrides["position_embedding_type"] = position_embedding_type
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # generation runs to max_new_tokens, so cached and uncached runs compare in full
    )
    kwargs.update(CONFORMANCE[name]["config"])
    kwargs.update(overrides)
    return VARIANTS[name].config(**kwargs)


def tiny_model(name: str, position_embedding_type: str | None = None, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(name, position_embedding_type, **overrides)
    model = VARIANTS[name].causal_lm_class(config).eval()
    if model.model.embed_positions is not None:  # learned positions start at zero (the NoPE model); tests need
        torch.nn.init.normal_(model.model.embed_positions.weight, std=config.initializer_range)  # ones that matter
    return model


def left_padded_batch(lengths=(11, 7, 4), seed: int = 1):
    """Random rows of the given lengths, left-padded with token 0: `(input_ids, attention_mask, rows)`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    rows = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator) for n in lengths]
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = row
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask, rows


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate` derives them: real tokens count from 0, pads sit at 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def works_with(request):
    """`works_with(client, variant)` records that a real client test passed for a variant; with `refused=reason`, that
    the variant refused the client up front as the test asserted; with `fails=reason`, that the real client ran and
    answered otherwise than the variant does (a defect the test xfails strictly, so the table says it while it lasts).
    `tests/works_with.py` runs the client tests with `--works-with PATH` and renders README's "Works with" table from
    what they recorded."""
    outcomes = request.config.stash.setdefault(WORKS_WITH, {})

    def record(client: str, variant: str, refused: str | None = None, fails: str | None = None) -> None:
        outcome = f"refused: {refused}" if refused else f"fails: {fails}" if fails else "works"
        outcomes.setdefault(client, {})[variant] = outcome

    return record


WORKS_WITH = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption(
        "--works-with",
        metavar="PATH",
        help="write what the client tests recorded (client -> variant -> works / refused: reason) to PATH as JSON",
    )


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--works-with")
    if path:
        Path(path).write_text(json.dumps(session.config.stash.get(WORKS_WITH, {}), indent=1, sort_keys=True) + "\n")


def pytest_configure(config):
    if config.getoption("--works-with") and getattr(config.option, "numprocesses", None):
        # each pytest-xdist worker would hold only its own tests' outcomes
        raise pytest.UsageError("--works-with records in one process: add -n 0")
    # The suite runs offline: nothing may reach the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def free_port() -> int:
    """A TCP port free right now, for a server or a process group's rendezvous: fixed ports collide when two test
    runs share a machine."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


# loads a checkpoint by its own code in a process where the package cannot be imported, and saves its logits
REMOTE_LOGITS = """
import sys
sys.modules["hf_attn_zoo"] = None
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def assert_loads_without_the_package(folder: str | Path, tmp_path: Path) -> None:
    """The checkpoint at `folder` loads by `trust_remote_code` where `hf_attn_zoo` cannot be imported, and gives
    the logits the package's own classes give (1e-5)."""
    from transformers import AutoModelForCausalLM

    if Version(transformers.__version__) < Version("5.3"):  # the rest of the calling test has passed by now
        pytest.skip("transformers < 5.3 cannot load remote code importing siblings (see test_checkpoints.py)")
    vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    command = [sys.executable, "-c", REMOTE_LOGITS, str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=1e-5)
