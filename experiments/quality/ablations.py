"""Cheap one-seed ablations behind three board cells: what differs at initialisation and early in training.

Three cells of the quality board trained to far worse perplexity than the literature puts them against their
neighbours: differential attention with its head norm, and gqa with sinusoidal or learned positions. Each ablation
here builds the model a board cell builds (`cell_fields`: the board's width, depth, heads, matched MLP), changes one
thing (a config field, an initialisation, the learning rate or the warm-up), and trains it for `--steps` steps of the
board's recipe (AdamW, its learning rate, cosine to 10% after 5% warm-up, weight decay on matrices, clipping at 1)
on random windows of the board's training addresses. It records, at initialisation, the RMS of the token embeddings,
of the position signal and of every residual branch's output, and the gradient norm of every block; during
training, the validation perplexity (the first `--eval_windows` windows of the 2001-2010 addresses), the RMS of the
token and position tables and differential's λ per layer.

Each ablation is one file, `<output_dir>/rows/<name>.json`, written when it ends: a rerun skips finished ones, and
several processes may run different `--ablations` at once. The table (`ablations.md`) is rebuilt from those files.

    python -m experiments quality-ablations [--ablations sinusoidal sinusoidal-before] [--steps 150]
"""

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from experiments.common import Benchmark, Results, main
from experiments.quality.quality import DATA, STUDY, Cell, QualitySetup, cell_fields, read_texts
from experiments.uptraining.uptraining import split_by_year
from hf_attn_zoo.checkpoints import write_atomically
from hf_attn_zoo.models import get_variant
from hf_attn_zoo.train.recipe import read_recipe


@dataclass(frozen=True)
class Ablation:
    """One change to a board cell: config `fields`, an initialisation (`token_std`, `position_std`: a normal table
    of that std; `head_norm_weight`: differential's per-head norm scale), a learning-rate factor or a warm-up."""

    variant: str
    positions: str
    what: str
    fields: dict = field(default_factory=dict)
    token_std: float | None = None
    position_std: float | None = None
    head_norm_weight: float | None = None
    lr_factor: float = 1.0
    warmup: float | None = None


ABLATIONS = {
    "rope": Ablation("gqa", "rope", "the neighbour: gqa with RoPE"),
    "none": Ablation("gqa", "none", "gqa without positions (NoPE)"),
    "sinusoidal-before": Ablation(
        "gqa",
        "sinusoidal",
        "tokens std 0.02 x sqrt(d) (RMS 0.23), sinusoids of amplitude 1",
        fields={"scale_embedding": True},
        token_std=0.02,
    ),
    "sinusoidal-before-lr0.5": Ablation(
        "gqa", "sinusoidal", "before, lr x0.5", fields={"scale_embedding": True}, token_std=0.02, lr_factor=0.5
    ),
    "sinusoidal-before-lr2": Ablation(
        "gqa", "sinusoidal", "before, lr x2", fields={"scale_embedding": True}, token_std=0.02, lr_factor=2
    ),
    "sinusoidal-vaswani": Ablation(
        "gqa",
        "sinusoidal",
        "tokens std 1/sqrt(d) x sqrt(d) (RMS 1), amplitude 1: fairseq, t2t",
        fields={"scale_embedding": True},
    ),
    "sinusoidal-token-rms": Ablation(
        "gqa",
        "sinusoidal",
        "tokens std 0.02 unscaled, sinusoids at the tokens' RMS (0.02)",
        fields={"sinusoid_amplitude": 0.02 * 2**0.5},
    ),
    "sinusoidal-token-rms-untied": Ablation(
        "gqa",
        "sinusoidal",
        "sinusoids at the tokens' RMS, output head untied from the token table",
        fields={"sinusoid_amplitude": 0.02 * 2**0.5, "tie_word_embeddings": False},
    ),
    "sinusoidal": Ablation("gqa", "sinusoidal", "tokens std 0.02 unscaled, sinusoids at a quarter of their RMS"),
    "learned-before": Ablation("gqa", "learned", "position table at std 0.02 (HF GPT-2, OPT)", position_std=0.02),
    "learned-before-lr0.5": Ablation("gqa", "learned", "before, lr x0.5", position_std=0.02, lr_factor=0.5),
    "learned-before-lr2": Ablation("gqa", "learned", "before, lr x2", position_std=0.02, lr_factor=2),
    "learned-0.01": Ablation("gqa", "learned", "position table at std 0.01 (GPT-2's own code)", position_std=0.01),
    "learned": Ablation("gqa", "learned", "position table at zero"),
    "differential-before": Ablation(
        "differential", "rope", "head norm scale at 1 (the paper's code)", head_norm_weight=1
    ),
    "differential-before-lr0.5": Ablation(
        "differential", "rope", "before, lr x0.5", head_norm_weight=1, lr_factor=0.5
    ),
    "differential-before-lr2": Ablation("differential", "rope", "before, lr x2", head_norm_weight=1, lr_factor=2),
    "differential-before-warmup-20%": Ablation(
        "differential", "rope", "before, warm-up 20% of the steps", head_norm_weight=1, warmup=0.2
    ),
    "differential-no-norm": Ablation(
        "differential", "rope", "no head norm (the paper's ablation)", fields={"differential_head_norm": False}
    ),
    "differential": Ablation("differential", "rope", "head norm scale at a value's RMS at init, 0.02·sqrt(d) = 0.23"),
}


@dataclass
class AblationSetup(Results):
    """One-seed ablations of the board's differential, sinusoidal and learned cells: init diagnostics, short runs."""

    output_dir: str = field(default=str(STUDY / "ablations"), metadata={"help": "rows/<name>.json and ablations.md"})
    data_dir: str = field(default=str(DATA / "sotu"), metadata={"help": "State of the Union folder (YEAR_*.txt)"})
    tokenizer: str = field(
        default=str(STUDY / "results" / "tokenizer"), metadata={"help": "the board's tokenizer (its results folder)"}
    )
    recipe: str = field(
        default=str(Path(__file__).resolve().parents[2] / "configs" / "train" / "quality_board.yaml"),
        metadata={"help": "the board's recipe: learning rate, batch, length, weight decay"},
    )
    ablations: list[str] = field(default_factory=lambda: list(ABLATIONS), metadata={"help": "names to run"})
    steps: int = field(default=100, metadata={"help": "optimizer steps of every ablation"})
    seed: int = field(default=0, metadata={"help": "one seed: ablations separate causes before seeds are spent"})
    eval_windows: int = field(default=32, metadata={"help": "validation windows of the training length"})
    evals: int = field(default=6, metadata={"help": "validation scores over the run (and one at the start)"})


def rms(tensor: torch.Tensor) -> float:
    return tensor.detach().float().pow(2).mean().sqrt().item()


def build(setup: AblationSetup, ablation: Ablation, vocab_size: int, block_size: int):
    """The board cell's model with the ablation's fields and initialisation."""
    board = QualitySetup(output_dir=setup.output_dir)  # the board's shape and --fields defaults
    fields, _, _ = cell_fields(board, Cell(ablation.variant, ablation.positions, setup.seed), vocab_size, block_size)
    fields = {**fields, **ablation.fields, "fuse_linear_cross_entropy": False}
    torch.manual_seed(setup.seed)
    model = get_variant(ablation.variant).build("small", **fields)
    base = model.model
    with torch.no_grad():
        if ablation.token_std is not None:
            base.embed_tokens.weight.normal_(0.0, ablation.token_std)
        if ablation.position_std is not None:
            base.embed_positions.weight.normal_(0.0, ablation.position_std)
        if ablation.head_norm_weight is not None:
            for layer in base.layers:
                layer.self_attn.head_norm.weight.fill_(ablation.head_norm_weight)
    return model


def position_rms(model, block_size: int) -> float:
    base = model.model
    if base.embed_positions is not None:
        return rms(base.embed_positions.weight[:block_size])
    # sinusoids of amplitude a have RMS a / sqrt(2) (sin and cos channels in pairs)
    return base.sinusoid_amplitude * 2**-0.5 if base.position_embedding_type == "sinusoidal" else 0.0


def lambdas(model) -> list[float] | None:
    attention = model.model.layers[0].self_attn
    if not hasattr(attention, "differential_lambda"):
        return None
    return [round(layer.self_attn.differential_lambda().item(), 4) for layer in model.model.layers]


def at_init(model, batch: torch.Tensor, block_size: int) -> dict:
    """RMS of the token embeddings, the position signal and each residual branch, and each block's gradient norm."""
    branches: dict[str, float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name, module in (("attention", layer.self_attn), ("mlp", layer.mlp)):
            hooks.append(
                module.register_forward_hook(
                    lambda _, __, out, key=f"{name}{i}": branches.__setitem__(
                        key, rms(out[0] if isinstance(out, tuple) else out)
                    )
                )
            )
    model.train()
    model(batch, labels=batch).loss.backward()
    for hook in hooks:
        hook.remove()
    gradients: dict[str, float] = {}
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        block = ".".join(parts[1:4]) if parts[1] == "layers" else ".".join(parts[1:-1]) or parts[0]
        gradients[block] = gradients.get(block, 0.0) + parameter.grad.float().pow(2).sum().item()
    model.zero_grad(set_to_none=True)
    return {
        "token_rms": rms(model.get_input_embeddings()(batch)),
        "position_rms": position_rms(model, block_size),
        "branch_rms": {k: round(v, 5) for k, v in branches.items()},
        "gradient_norms": {k: round(math.sqrt(v), 5) for k, v in gradients.items()},
    }


def validation_perplexity(model, windows: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        losses = [model(window[None], labels=window[None]).loss.item() for window in windows]
    model.train()
    return math.exp(sum(losses) / len(losses))


def run_ablation(setup: AblationSetup, name: str, data: dict) -> dict:
    ablation = ABLATIONS[name]
    recipe = read_recipe(setup.recipe)
    block, batch_size = recipe["data"]["block_size"], recipe["training"]["per_device_train_batch_size"]
    training = recipe["training"]
    model = build(setup, ablation, len(data["tokenizer"]), block)
    generator = torch.Generator().manual_seed(setup.seed)
    train = data["train"]

    def batch() -> torch.Tensor:  # (batch, block): random windows of the training addresses
        starts = torch.randint(0, len(train) - block - 1, (batch_size,), generator=generator)
        return torch.stack([train[s : s + block] for s in starts.tolist()])

    init = at_init(model, batch(), block)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    lr = training["learning_rate"] * ablation.lr_factor
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": training["weight_decay"]}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
    )
    warmup = max(1, round((ablation.warmup or training["warmup_steps"]) * setup.steps))
    floor = training["lr_scheduler_kwargs"]["min_lr_rate"]

    def factor(step: int) -> float:  # linear warm-up, then cosine down to `floor` of the peak (the recipe's schedule)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, setup.steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    windows = data["validation"]
    trajectory = []
    every = max(1, setup.steps // setup.evals)
    start = time.perf_counter()
    for step in range(setup.steps + 1):
        if step % every == 0 or step == setup.steps:
            trajectory.append(
                {
                    "step": step,
                    "validation_perplexity": round(validation_perplexity(model, windows), 3),
                    "token_table_rms": round(rms(model.get_input_embeddings().weight), 5),
                    "position_rms": round(position_rms(model, block), 5),
                    "lambda": lambdas(model),
                }
            )
        if step == setup.steps:
            break
        inputs = batch()
        model(inputs, labels=inputs).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "name": name,
        "variant": ablation.variant,
        "positions": ablation.positions,
        "what": ablation.what,
        "learning_rate": lr,
        "steps": setup.steps,
        "seed": setup.seed,
        "train_tokens": setup.steps * batch_size * block,
        "seconds": round(time.perf_counter() - start, 1),
        "init": init,
        "trajectory": trajectory,
        "validation_perplexity": trajectory[-1]["validation_perplexity"],
    }


def table(rows: dict[str, dict]) -> str:
    """ablations.md: one line per finished ablation, in the order of ABLATIONS, its perplexity against RoPE's."""
    reference = rows.get("rope", {}).get("validation_perplexity")
    any_row = next(iter(rows.values()))
    lines = [
        f"One-seed ablations: {any_row['steps']} steps of the quality board's recipe ({any_row['train_tokens']:,} "
        "tokens), validation perplexity on the first windows of the 2001-2010 addresses. RMS at initialisation: of "
        "the token embeddings as they enter the residual stream, of the position signal added to them, and of the "
        "first layer's attention branch output. `python -m experiments quality-ablations` (experiments/quality/"
        "ablations.py).",
        "",
        "| ablation | cell | what changes | lr | token RMS | position RMS | attention branch RMS (layer 0) | "
        "val ppl | against rope | λ per layer at the end |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name in [n for n in ABLATIONS if n in rows]:
        row = rows[name]
        init = row["init"]
        ratio = f"{row['validation_perplexity'] / reference:.2f}x" if reference else ""
        lam = row["trajectory"][-1]["lambda"]
        lines.append(
            f"| {name} | {row['variant']} ({row['positions']}) | {row['what']} | {row['learning_rate']:.0e} | "
            f"{init['token_rms']:.3f} | {init['position_rms']:.3f} | {init['branch_rms']['attention0']:.4f} | "
            f"{row['validation_perplexity']:.1f} | {ratio} | {' '.join(f'{x:.2f}' for x in lam) if lam else ''} |"
        )
    return "\n".join(lines) + "\n"


def run_ablations(setup: AblationSetup, log: Callable[[str], None] = print) -> dict[str, dict]:
    unknown = [name for name in setup.ablations if name not in ABLATIONS]
    if unknown:
        raise SystemExit(f"unknown ablation(s) {' '.join(unknown)}: known are {' '.join(ABLATIONS)}")
    runs = Path(setup.output_dir) / "rows"
    runs.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(setup.tokenizer)
    splits = split_by_year(setup.data_dir)
    block = read_recipe(setup.recipe)["data"]["block_size"]
    validation = torch.tensor(tokenizer("\n\n".join(read_texts(splits["validation"])))["input_ids"])
    data = {
        "tokenizer": tokenizer,
        "train": torch.tensor(tokenizer("\n\n".join(read_texts(splits["train"])))["input_ids"]),
        # (eval_windows, block): consecutive windows from the start of the validation addresses
        "validation": validation[: setup.eval_windows * block].view(setup.eval_windows, block),
    }
    todo = [name for name in setup.ablations if not (runs / f"{name}.json").is_file()]
    for name in tqdm(todo, desc="ablations", unit="run", file=sys.stdout):
        row = run_ablation(setup, name, data)
        write_atomically(runs / f"{name}.json", json.dumps(row, indent=2) + "\n")
        log(f"{name}: validation perplexity {row['validation_perplexity']:.1f} ({row['seconds'] / 60:.1f} min)")
    rows = {path.stem: json.loads(path.read_text()) for path in sorted(runs.glob("*.json"))}
    write_atomically(Path(setup.output_dir) / "ablations.md", table(rows))
    log(f"table: {Path(setup.output_dir) / 'ablations.md'}")
    return rows


BENCHMARKS = {"quality-ablations": Benchmark(AblationSetup, run_ablations)}

if __name__ == "__main__":
    sys.exit(main(BENCHMARKS))
