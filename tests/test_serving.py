"""`hf-attn-zoo serve`: every variant behind transformers' own OpenAI-compatible server, compared with `generate()`.

The server tests (slow) save a tiny checkpoint with a character-level tokenizer and a chat template, start
`hf-attn-zoo serve` on a free port in a subprocess, and send a chat request, a streamed chat request and a completion
over HTTP. Each answer must be exactly the text of the checkpoint's own greedy `generate()`. With
`--continuous_batching` the requests go out concurrently, so that transformers packs them into one batch; a variant
whose attention class refuses continuous batching must instead make the server exit before it listens, with one line
naming the variant, the reason and what to run instead. The refusal itself is checked in-process (fast).
"""

import concurrent.futures
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_attn_zoo.models import VARIANTS, clients_zoo
from hf_attn_zoo.serving import continuous_batching_refusal
from hf_attn_zoo_cli import main

from conftest import CONFORMANCE, free_port, tiny_model

NAMES = [name for name in VARIANTS if name in CONFORMANCE]
# transformers serves Mistral (causal window) under continuous batching: these must serve exactly there too
MUST_BATCH = {"mha", "gqa", "mqa", "single_head", "sliding_window"}

# on one line: the tokenizer has printable characters only (a newline would be the unknown token, which is padding)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "user", "content": "what is a window?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok"}],
]
PROMPTS = ["def f(x):", "the cat sat on", "1 2 3 4 5 6 7 8 9"]
MAX_TOKENS = 12
STARTUP_SECONDS = 180


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (97 ids, the conftest vocabulary), so any generated text decodes the
    same whole or streamed; `<|endoftext|>` is 0, `<|pad|>` 1."""
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_checkpoint(name: str, folder: Path, **overrides) -> Path:
    """A tiny `name` checkpoint with the character tokenizer; no EOS, so every answer runs to `MAX_TOKENS`."""
    tokenizer = char_tokenizer()
    model = tiny_model(name, pad_token_id=tokenizer.pad_token_id, **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def expected_texts(folder: Path) -> dict[str, list[str]]:
    """What the checkpoint's own greedy `generate()` answers to each chat and prompt, loaded as the server loads it."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = char_tokenizer()

    def answer(inputs: dict) -> str:
        output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    chats = [
        answer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True))
        for chat in CHATS
    ]
    return {"chat": chats, "completion": [answer(tokenizer(p, return_tensors="pt")) for p in PROMPTS]}


def serve_process(folder: Path, port: int, log: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "hf_attn_zoo_cli", "serve", str(folder), "--port", str(port), *flags]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, text=True)


class Server:
    """`hf-attn-zoo serve` in a subprocess, stopped on exit; `chat`, `streamed_chat` and `completion` ask it through
    the OpenAI client."""

    def __init__(self, folder: Path, log: Path, *flags: str) -> None:
        self.folder, self.log, self.port = folder, log, free_port()
        self.url = f"http://localhost:{self.port}"
        self.process = serve_process(folder, self.port, log, *flags)

    def __enter__(self) -> "Server":
        from openai import OpenAI

        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited at start-up:\n{self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:  # not listening yet
                time.sleep(0.5)
        else:
            raise AssertionError(f"server not up after {STARTUP_SECONDS} s:\n{self.log.read_text()[-3000:]}")
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, max_retries=0)
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def chat(self, messages: list[dict]) -> str:
        response = self.client.chat.completions.create(
            model=str(self.folder), messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return response.choices[0].message.content

    def streamed_chat(self, messages: list[dict]) -> str:
        stream = self.client.chat.completions.create(
            model=str(self.folder), messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)

    def completion(self, prompt: str) -> str:
        response = self.client.completions.create(
            model=str(self.folder), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return response.choices[0].text

    def all_answers(self, at_once: bool) -> dict[str, list[str]]:
        """Every chat (plain and streamed) and completion; with `at_once`, all in flight together."""
        jobs = {
            "chat": [(self.chat, chat) for chat in CHATS],
            "streamed": [(self.streamed_chat, chat) for chat in CHATS],
            "completion": [(self.completion, prompt) for prompt in PROMPTS],
        }
        if not at_once:
            return {kind: [call(arg) for call, arg in calls] for kind, calls in jobs.items()}
        with concurrent.futures.ThreadPoolExecutor(max_workers=sum(map(len, jobs.values()))) as pool:
            futures = {kind: [pool.submit(call, arg) for call, arg in calls] for kind, calls in jobs.items()}
            return {kind: [future.result() for future in items] for kind, items in futures.items()}


def serving_extra() -> None:
    for module in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(module, reason="the [serving] extra (transformers[serving]) is not installed")


def reason_of(name: str) -> str | None:
    """The variant's own answer: why continuous batching cannot run it, or None."""
    config = tiny_model(name).config
    return clients_zoo.continuous_batching_refusal(VARIANTS[name].attention_class, config)


# fast: the refusal is decided before anything is served


@pytest.mark.parametrize("name", NAMES)
def test_continuous_batching_is_refused_up_front_or_not_at_all(name, tmp_path, capsys):
    folder = save_checkpoint(name, tmp_path / name)
    line = continuous_batching_refusal(folder)
    if name in MUST_BATCH:
        assert line is None
        return
    model_type = VARIANTS[name].model_type
    assert line is not None and "\n" not in line, line
    assert model_type in line and reason_of(name) in line and "without --continuous_batching" in line, line
    serving_extra()  # the command checks that the server can run at all first
    capsys.readouterr()  # what saving the checkpoint printed
    # a free port: never the default one, which another run on the machine may hold
    assert main(["serve", str(folder), "--port", str(free_port()), "--continuous_batching"]) == 2
    assert capsys.readouterr().err.strip() == line


def test_alibi_refuses_continuous_batching_in_the_mha_family(tmp_path):
    folder = save_checkpoint("gqa", tmp_path / "gqa-alibi", position_embedding_type="alibi")
    line = continuous_batching_refusal(folder)
    assert line is not None and "ALiBi" in line and "zoo_gqa" in line, line


# slow: the real server, over HTTP


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_serve_gives_generate_output(name, tmp_path, works_with):
    serving_extra()
    folder = save_checkpoint(name, tmp_path / name)
    expected = expected_texts(folder)
    with Server(folder, tmp_path / "server.log") as server:
        answers = server.all_answers(at_once=False)
    assert answers == {"chat": expected["chat"], "streamed": expected["chat"], "completion": expected["completion"]}
    works_with("serve", name)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_serve_with_continuous_batching_gives_generate_output_or_refuses_at_start(name, tmp_path, works_with):
    serving_extra()
    folder = save_checkpoint(name, tmp_path / name)
    reason = reason_of(name)
    if name in MUST_BATCH:
        assert reason is None, reason
    if reason is not None:
        log = tmp_path / "server.log"
        process = serve_process(folder, free_port(), log, "--continuous_batching")
        assert process.wait(timeout=STARTUP_SECONDS) == 2, log.read_text()[-3000:]
        output = log.read_text()
        assert f"{VARIANTS[name].model_type} cannot be served with --continuous_batching: {reason}" in output
        assert "Uvicorn running" not in output  # it never listened
        works_with("serve-cb", name, refused=reason)
        return
    expected = expected_texts(folder)
    with Server(folder, tmp_path / "server.log", "--continuous_batching") as server:
        answers = server.all_answers(at_once=True)
        log = server.log.read_text()
        still_serving = server.completion("x")  # the batching worker survived the batch
    assert "CB: True" in log, log[-3000:]  # the requests went through continuous batching
    assert isinstance(still_serving, str)
    assert answers == {"chat": expected["chat"], "streamed": expected["chat"], "completion": expected["completion"]}
    works_with("serve-cb", name)
