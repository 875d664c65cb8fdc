"""Speed and memory of the zoo's encoder-decoders, in one process: the MHA encoder-decoder against transformers' own
`T5ForConditionalGeneration` of the same sizes, the cross-attention cache of each kind, and the RNN translator.

seq2seq   1. Training tokens/s (forward, backward, AdamW step on random pairs; source and target tokens counted) and
          greedy `generate()` tokens/s (exactly `new_tokens` per row, batches 1 and 8, encoder pass included) of the
          zoo MHA encoder-decoder and of T5, alternating samples, ratio zoo / T5 from back-to-back pairs. T5 is the
          nearest native analog of the zoo's backbone (pre-norm RMSNorm, no biases): `feed_forward_proj="gated-silu"`
          gives it the zoo's SwiGLU MLP, `d_kv` the zoo's head width, `d_ff` its MLP width, the same layers, heads
          and vocabulary, tied embeddings, no dropout, the same attention backend. What still differs: T5's learned
          relative position bias (added to every layer's self-attention scores) against the zoo's RoPE (rotating
          queries and keys), and T5's rescaling of the tied head's input by d_model^-0.5.
          `BartForConditionalGeneration` of the same sizes is the second control (post-norm LayerNorm, learned
          absolute positions, biases, a plain GELU MLP 1.5 times as wide so its two matrices hold the gated MLP's
          three). Each model's training FLOPs per token are counted by torch's `FlopCounterMode` over one step
          (forward and backward), and its utilisation is the FLOP/s it reaches against the machine's fp32 matmul
          peak, measured in the same process (the fastest square matmul of `--peak_size`).
          2. Cross-attention cache bytes per source token for MHA, GQA and MQA dot-product cross-attention and for
          additive (Bahdanau) cross-attention, measured on the `EncoderDecoderCache.cross_attention_cache` a
          `generate()` returns, beside the formula.
          3. The RNN translator (`zoo_rnn`, bidirectional GRU and Bahdanau attention) against the same Transformer at
          matched parameters (`rnn_hidden_size` searched to the closest count): training tokens/s, alternating.
          Writes results/seq2seq.md and .json.

    python -m experiments seq2seq [--repeats 11] [--encoder_layers 3] [--threads 2] [--output_dir DIR]
"""

import copy
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

from experiments.common import Benchmark, Results, alternate, compare, fastest, main, paired_ratio, write_results
from experiments.speed.scaling import cache_nbytes
from hf_attn_zoo.models import SEQ2SEQ
from hf_attn_zoo.models.compat_zoo import CACHE_KWARG


@dataclass
class Seq2SeqSpeedSetup(Results):
    """The MHA encoder-decoder against T5 of the same sizes, cross-attention cache bytes, the RNN translator."""

    vocab_size: int = field(default=8192, metadata={"help": "shared source/target vocabulary of every model"})
    hidden_size: int = field(default=256, metadata={"help": "model width (T5's d_model)"})
    intermediate_size: int = field(default=688, metadata={"help": "MLP width (T5's d_ff)"})
    encoder_layers: int = field(default=3, metadata={"help": "encoder layers"})
    decoder_layers: int = field(default=3, metadata={"help": "decoder layers"})
    num_attention_heads: int = field(default=8, metadata={"help": "query heads (head width: hidden / heads)"})
    gqa_key_value_heads: int = field(default=2, metadata={"help": "key/value heads of the GQA cross-attention row"})
    train_batch_size: int = field(default=8, metadata={"help": "training pairs per step"})
    source_len: int = field(default=128, metadata={"help": "source tokens per pair (training and generate)"})
    target_len: int = field(default=128, metadata={"help": "target tokens per pair in training"})
    train_steps: int = field(default=3, metadata={"help": "timed training steps per sample; the fastest counts"})
    new_tokens: int = field(default=64, metadata={"help": "generate(): new tokens per row, exactly"})
    decode_batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata={"help": "generate() batches"})
    decode_runs: int = field(default=3, metadata={"help": "generate() calls per sample; the fastest counts"})
    cache_batch_size: int = field(
        default=2, metadata={"help": "generate() batch whose cross-attention cache is sized"}
    )
    repeats: int = field(default=11, metadata={"help": "alternating samples per model and metric"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "attention backend of the zoo model and T5"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)"})
    peak_size: int = field(default=1024, metadata={"help": "side of the square fp32 matmul that measures the peak"})

    @property
    def head_dim(self) -> int:
        if self.hidden_size % self.num_attention_heads:
            raise SystemExit(f"--num_attention_heads {self.num_attention_heads} must divide --hidden_size")
        return self.hidden_size // self.num_attention_heads


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter: counted once


def build_zoo(setup: Seq2SeqSpeedSetup, variant: str = "mha", **fields) -> torch.nn.Module:
    """The zoo encoder-decoder of `variant` at the setup's sizes (`fields` override, e.g. the cross-attention's)."""
    torch.manual_seed(0)
    return SEQ2SEQ[variant].build(
        None,
        vocab_size=setup.vocab_size,
        hidden_size=setup.hidden_size,
        intermediate_size=setup.intermediate_size,
        num_hidden_layers=setup.decoder_layers,
        encoder_layers=setup.encoder_layers,
        decoder_layers=setup.decoder_layers,
        num_attention_heads=setup.num_attention_heads,
        num_key_value_heads=setup.num_attention_heads,
        max_position_embeddings=max(setup.source_len, setup.target_len, setup.new_tokens + 1),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # generate() runs to exactly new_tokens whatever the random weights prefer
        decoder_start_token_id=0,  # T5's choice (pad), so both decoders start from the same token
        attn_implementation=setup.attn_implementation,
        **fields,
    )


def build_t5(setup: Seq2SeqSpeedSetup) -> T5ForConditionalGeneration:
    """T5 of the zoo MHA encoder-decoder's sizes: gated-SiLU MLP (SwiGLU), `d_kv` = head width, tied embeddings."""
    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=setup.vocab_size,
            d_model=setup.hidden_size,
            d_kv=setup.head_dim,
            d_ff=setup.intermediate_size,
            num_layers=setup.encoder_layers,
            num_decoder_layers=setup.decoder_layers,
            num_heads=setup.num_attention_heads,
            feed_forward_proj="gated-silu",
            tie_word_embeddings=True,
            dropout_rate=0.0,  # the zoo model trains without dropout here too
            pad_token_id=0,
            eos_token_id=None,
            decoder_start_token_id=0,
            attn_implementation=setup.attn_implementation,
        )
    )


def build_bart(setup: Seq2SeqSpeedSetup) -> BartForConditionalGeneration:
    """BART of the zoo MHA encoder-decoder's sizes: its plain GELU MLP 1.5 times the gated width (two matrices of
    d x 1.5f hold as many weights as the gated MLP's three of d x f), tied embeddings, no dropout."""
    torch.manual_seed(0)
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=setup.vocab_size,
            d_model=setup.hidden_size,
            encoder_layers=setup.encoder_layers,
            decoder_layers=setup.decoder_layers,
            encoder_attention_heads=setup.num_attention_heads,
            decoder_attention_heads=setup.num_attention_heads,
            encoder_ffn_dim=3 * setup.intermediate_size // 2,
            decoder_ffn_dim=3 * setup.intermediate_size // 2,
            max_position_embeddings=max(setup.source_len, setup.target_len, setup.new_tokens + 1),
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            decoder_start_token_id=0,
            attn_implementation=setup.attn_implementation,
        )
    )


def build_rnn(setup: Seq2SeqSpeedSetup, rnn_hidden_size: int) -> torch.nn.Module:
    """The RNN translator at the Transformer's width and vocabulary, its recurrent state `rnn_hidden_size` wide."""
    torch.manual_seed(0)
    return SEQ2SEQ["rnn"].build(
        None,
        vocab_size=setup.vocab_size,
        hidden_size=setup.hidden_size,
        rnn_hidden_size=rnn_hidden_size,
        dropout=0.0,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        decoder_start_token_id=0,
    )


def matched_rnn(setup: Seq2SeqSpeedSetup, target: int) -> tuple[torch.nn.Module, int]:
    """The RNN translator whose parameter count is closest to `target`, and its `rnn_hidden_size`: the count grows
    with the state size, so a bisection over it finds the crossing; the nearer of the two sizes around it wins."""
    low, high = 1, 8 * setup.hidden_size
    while high - low > 1:
        middle = (low + high) // 2
        if parameters(build_rnn(setup, middle)) < target:
            low = middle
        else:
            high = middle
    size = min((low, high), key=lambda n: abs(parameters(build_rnn(setup, n)) - target))
    return build_rnn(setup, size), size


def random_pairs(setup: Seq2SeqSpeedSetup, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, target) token ids above the special ids (0 is padding and the start token): the data does not change
    the arithmetic, and no padding means every token counted is computed."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, setup.vocab_size, (batch_size, setup.source_len), generator=generator)
    target = torch.randint(3, setup.vocab_size, (batch_size, setup.target_len), generator=generator)
    return source, target


def training_tokens_per_second(model: torch.nn.Module, setup: Seq2SeqSpeedSetup) -> float:
    """Source plus target tokens per second of forward (labels shifted right into decoder inputs by the model),
    backward and an AdamW step; the fastest of `train_steps` timed steps, after one that allocates the optimizer's
    state."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    source, target = random_pairs(setup, setup.train_batch_size, seed=0)

    def step() -> None:
        model(input_ids=source, labels=target).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return setup.train_batch_size * (setup.source_len + setup.target_len) / fastest(step, setup.train_steps)


def training_flops_per_token(model: torch.nn.Module, setup: Seq2SeqSpeedSetup) -> float:
    """FLOPs of one training step's forward and backward (the optimizer's elementwise work left out, as MFU does),
    counted by torch's `FlopCounterMode` (matmuls and attention), per source + target token."""
    model.train()
    source, target = random_pairs(setup, setup.train_batch_size, seed=0)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=source, labels=target).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / (setup.train_batch_size * (setup.source_len + setup.target_len))


def matmul_peak(setup: Seq2SeqSpeedSetup, runs: int = 50) -> float:
    """FLOP/s of the fastest fp32 `n x n @ n x n` matmul (2n^3 FLOPs) at this process' thread count: the machine's
    practical peak, the denominator of the utilisation. The fastest of many runs, as every timing here: on a shared
    machine interference only adds time (`measure` takes it before and after the models and keeps the faster)."""
    n = setup.peak_size
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # first call: allocations
    return 2 * n**3 / fastest(lambda: a @ b, runs)


def generate_kwargs(new_tokens: int) -> dict:
    return dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=0)


@torch.no_grad()
def generate_tokens_per_second(model: torch.nn.Module, setup: Seq2SeqSpeedSetup, batch_size: int) -> float:
    """New tokens per second of greedy `generate()` as a user calls it (the encoder pass included), exactly
    `new_tokens` per row; the fastest of `decode_runs` calls."""
    model.eval()
    source, _ = random_pairs(setup, batch_size, seed=1)
    kwargs = generate_kwargs(setup.new_tokens)
    return batch_size * setup.new_tokens / fastest(lambda: model.generate(source, **kwargs), setup.decode_runs)


# the cross-attention kinds measured: name -> the config fields that declare it (key/value heads filled in per setup)
def cross_attention_kinds(setup: Seq2SeqSpeedSetup) -> dict[str, dict]:
    return {
        "MHA": {"cross_attention": "dot", "cross_attention_num_key_value_heads": setup.num_attention_heads},
        "GQA": {"cross_attention": "dot", "cross_attention_num_key_value_heads": setup.gqa_key_value_heads},
        "MQA": {"cross_attention": "dot", "cross_attention_num_key_value_heads": 1},
        "additive": {"cross_attention": "additive"},
    }


@torch.no_grad()
def cross_attention_cache(setup: Seq2SeqSpeedSetup) -> list[dict]:
    """Per kind: the bytes of the cross-attention cache a greedy `generate()` returns, per source token (divided by
    batch and source length), beside the formula: dot-product caches keys and values, `2 * L * G * d_h` numbers per
    token; additive caches keys projected into the tanh layer and values, `L * G * (a + d_h)`."""
    rows = []
    for kind, fields in cross_attention_kinds(setup).items():
        model = build_zoo(setup, **fields).eval()
        config = model.config
        source, _ = random_pairs(setup, setup.cache_batch_size, seed=2)
        out = model.generate(source, return_dict_in_generate=True, **generate_kwargs(4))
        measured = cache_nbytes(getattr(out, CACHE_KWARG).cross_attention_cache)
        heads, width = config.cross_attention_num_key_value_heads, config.head_dim
        key_width = config.cross_attention_additive_dim if config.cross_attention == "additive" else width
        element = next(model.parameters()).element_size()
        rows.append(
            {
                "kind": kind,
                "cross_attention": config.cross_attention,
                "key_value_heads": heads,
                "key_width": key_width,
                "value_width": width,
                "bytes_per_source_token": measured / (setup.cache_batch_size * setup.source_len),
                "formula_bytes_per_source_token": config.decoder_layers * heads * (key_width + width) * element,
            }
        )
    return rows


@dataclass
class Seq2SeqSpeedReport:
    setup: Seq2SeqSpeedSetup
    parameters: dict[str, int] = field(default_factory=dict)
    rnn_hidden_size: int = 0
    # metric -> {"zoo": [tokens/s per repeat], "t5": [...], "bart": [...]}
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # model -> counted training FLOPs per token; the fp32 matmul peak (FLOP/s) measured beside them
    flops_per_token: dict[str, float] = field(default_factory=dict)
    peak_flops: float = 0.0
    # {"rnn": [training tokens/s per repeat], "transformer": [...]}
    rnn_samples: dict[str, list[float]] = field(default_factory=dict)
    cross_attention_cache: list[dict] = field(default_factory=list)
    threads: int = field(default_factory=torch.get_num_threads)
    machine: str = field(default_factory=lambda: f"{platform.machine()}, torch {torch.__version__}")

    def ratios(self, baseline: str = "t5") -> dict[str, float]:
        return {metric: paired_ratio(samples["zoo"], samples[baseline]) for metric, samples in self.samples.items()}

    def utilisation(self) -> dict[str, dict[str, float]]:
        """Per model: training tokens/s (median), counted FLOPs per token, FLOP/s reached and its share of the
        matmul peak."""
        training = next(iter(self.samples.values()))  # the first metric is training
        rows = {}
        for name, flops in self.flops_per_token.items():
            tokens_per_second = statistics.median(training[name])
            achieved = tokens_per_second * flops
            rows[name] = {
                "tokens_per_second": tokens_per_second,
                "flops_per_token": flops,
                "flops_per_second": achieved,
                "of_peak": achieved / self.peak_flops,
            }
        return rows

    def rnn(self) -> dict[str, float]:
        return compare(self.rnn_samples, "tokens_per_second")

    def table(self) -> str:
        s, p = self.setup, self.parameters
        lines = [
            f"Zoo MHA encoder-decoder ({p['zoo'] / 1e6:.2f}M parameters, RoPE) vs `T5ForConditionalGeneration` "
            f"({p['t5'] / 1e6:.2f}M parameters, learned relative position bias; tied head input scaled by "
            f"d_model^-0.5): {s.encoder_layers}+{s.decoder_layers} layers x {s.hidden_size}, {s.num_attention_heads} "
            f"heads of {s.head_dim}, SwiGLU MLP {s.intermediate_size} (T5 `gated-silu`), vocabulary {s.vocab_size}, "
            f"tied embeddings, no dropout, {s.attn_implementation}, {self.threads} threads ({self.machine}); "
            f"best-of-run samples, medians of {s.repeats} alternating repeats, ratios the medians of back-to-back "
            "pairs. Training counts source + target tokens; generate() is greedy, exactly "
            f"{s.new_tokens} new tokens per row from a {s.source_len}-token source, the encoder pass included.",
            "",
            f"`BartForConditionalGeneration` ({p['bart'] / 1e6:.2f}M parameters: post-norm LayerNorm, learned "
            f"positions, biases, GELU MLP {3 * s.intermediate_size // 2}) is the second control.",
            "",
            "| metric | T5 tokens/s | BART tokens/s | zoo tokens/s | zoo / T5 | zoo / BART |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        ratios, bart = self.ratios(), self.ratios("bart")
        for metric, samples in self.samples.items():
            medians = " | ".join(f"{statistics.median(samples[name]):,.0f}" for name in ("t5", "bart", "zoo"))
            lines.append(f"| {metric} | {medians} | {ratios[metric]:.3f} | {bart[metric]:.3f} |")
        lines += [
            "",
            "Training FLOPs utilisation: FLOPs per token counted by torch's `FlopCounterMode` over one step's "
            f"forward and backward, times the median training tokens/s, against the fastest fp32 {s.peak_size}x"
            f"{s.peak_size} matmul in the same process ({self.peak_flops / 1e9:,.1f} GFLOP/s).",
            "",
            "| model | parameters | FLOPs / token | tokens/s | GFLOP/s | of matmul peak |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        names = {"zoo": "zoo MHA", "t5": "T5", "bart": "BART"}
        for name, row in self.utilisation().items():
            lines.append(
                f"| {names[name]} | {p[name]:,} | {row['flops_per_token'] / 1e6:,.1f}M | "
                f"{row['tokens_per_second']:,.0f} | {row['flops_per_second'] / 1e9:,.1f} | {row['of_peak']:.1%} |"
            )
        lines += [
            "",
            f"Cross-attention cache after `generate()` (batch {s.cache_batch_size}, {s.source_len}-token source, "
            f"float32, L = {s.decoder_layers} decoder layers; self-attention MHA in every row): bytes per source "
            "token, measured on `EncoderDecoderCache.cross_attention_cache`, and the formula (dot: 2·L·G·d_h, "
            "additive: L·G·(a + d_h) numbers).",
            "",
            "| cross-attention | key/value heads | key width | bytes / source token | formula | vs MHA |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        mha = self.cross_attention_cache[0]["bytes_per_source_token"]
        for row in self.cross_attention_cache:
            lines.append(
                f"| {row['kind']} | {row['key_value_heads']} | {row['key_width']} | "
                f"{row['bytes_per_source_token']:,.0f} | {row['formula_bytes_per_source_token']:,} | "
                f"{row['bytes_per_source_token'] / mha:.3f} |"
            )
        rnn = self.rnn()
        lines += [
            "",
            f"RNN translator (`zoo_rnn`: bidirectional GRU encoder, GRU decoder with Bahdanau attention, embeddings "
            f"{s.hidden_size} wide, `rnn_hidden_size` {self.rnn_hidden_size} searched to match: {p['rnn'] / 1e6:.2f}M "
            f"parameters, {p['rnn'] / p['zoo'] - 1:+.1%} of the Transformer's {p['zoo'] / 1e6:.2f}M) against the zoo "
            f"MHA encoder-decoder: training tokens/s at the same batch and lengths, alternating.",
            "",
            "| model | parameters | training tokens/s |",
            "| --- | ---: | ---: |",
            f"| Transformer (zoo MHA) | {p['zoo']:,} | {rnn['tokens_per_second_transformer']:,.0f} |",
            f"| RNN (zoo_rnn) | {p['rnn']:,} | {rnn['tokens_per_second_rnn']:,.0f} |",
            f"| RNN / Transformer | {p['rnn'] / p['zoo']:.3f} | {rnn['tokens_per_second_ratio']:.3f} |",
        ]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "ratios": self.ratios(),
            "ratios_bart": self.ratios("bart"),
            "utilisation": self.utilisation(),
            "rnn": self.rnn(),
        }


def measure(setup: Seq2SeqSpeedSetup, log: Callable[[str], None] = print) -> Seq2SeqSpeedReport:
    if setup.threads:
        torch.set_num_threads(setup.threads)
    zoo, t5, bart = build_zoo(setup), build_t5(setup), build_bart(setup)
    report = Seq2SeqSpeedReport(setup=copy.deepcopy(setup))
    models = {"zoo": zoo, "t5": t5, "bart": bart}
    report.parameters = {name: parameters(model) for name, model in models.items()}
    report.flops_per_token = {name: training_flops_per_token(model, setup) for name, model in models.items()}
    report.peak_flops = matmul_peak(setup)  # again after the models (below): the faster of the two counts
    training = f"training (batch {setup.train_batch_size}, source {setup.source_len} + target {setup.target_len})"
    metrics: dict[str, Callable] = {training: lambda m: training_tokens_per_second(m, setup)}
    for batch_size in setup.decode_batch_sizes:
        metrics[f"generate (batch {batch_size}, {setup.new_tokens} new)"] = lambda m, b=batch_size: (
            generate_tokens_per_second(m, setup, b)
        )

    def progress(repeat: int, samples: dict) -> None:
        ratios = ", ".join(
            f"{s['zoo'][-1] / s['t5'][-1]:.3f} / {s['zoo'][-1] / s['bart'][-1]:.3f}" for s in samples.values()
        )
        log(f"repeat {repeat + 1}/{setup.repeats}: zoo / T5, zoo / BART {ratios}")

    report.samples = alternate(models, metrics, setup.repeats, after_repeat=progress)
    del t5, bart, models
    report.peak_flops = max(report.peak_flops, matmul_peak(setup))

    report.cross_attention_cache = cross_attention_cache(setup)
    sizes = (f"{row['kind']} {row['bytes_per_source_token']:,.0f} B" for row in report.cross_attention_cache)
    log(f"cross-attention cache per source token: {', '.join(sizes)}")

    rnn, report.rnn_hidden_size = matched_rnn(setup, report.parameters["zoo"])
    report.parameters["rnn"] = parameters(rnn)
    log(f"RNN: rnn_hidden_size {report.rnn_hidden_size}, {report.parameters['rnn']:,} parameters")
    report.rnn_samples = alternate(
        {"rnn": rnn, "transformer": zoo}, {"training": lambda m: training_tokens_per_second(m, setup)}, setup.repeats
    )["training"]
    return report


def run(setup: Seq2SeqSpeedSetup) -> Seq2SeqSpeedReport:
    report = measure(setup)
    write_results(setup.output_dir, "seq2seq", report.as_dict(), report.table())
    return report


BENCHMARKS = {"seq2seq": Benchmark(Seq2SeqSpeedSetup, run, results="seq2seq")}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
