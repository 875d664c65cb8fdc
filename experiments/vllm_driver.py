"""Runs inside vLLM's environment (`vllm_env.py`): offline greedy generation with `vllm.LLM`, timed.

    python vllm_driver.py REQUEST.json ANSWER.json

REQUEST: `model` (a folder), `prompts` (texts), `max_tokens`, and optionally `model_impl` ("auto": vLLM's own class
for the architecture; "transformers": its transformers backend), `enforce_eager` (no torch.compile), `max_model_len`,
`dtype`, `repeats` (timed generations after the first). ANSWER: `token_ids` (the generated ids per prompt),
`prompt_token_ids` (the prompts as vLLM tokenized them), `model_class` (the class vLLM resolved),
`startup_seconds` and `generate_seconds` (one per timed generation).

It imports nothing of the zoo: a zoo checkpoint runs from the modules it carries (`trust_remote_code`), as it would
for any user of vLLM. vLLM starts its engine in a subprocess with `spawn`, which re-imports this file; the work stays
under `if __name__ == "__main__"`.
"""

import json
import sys
import time


def main(request_path: str, answer_path: str) -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(open(request_path).read())
    start = time.perf_counter()
    llm = LLM(
        model=request["model"],
        model_impl=request.get("model_impl", "auto"),
        trust_remote_code=True,
        dtype=request.get("dtype", "float32"),
        enforce_eager=request.get("enforce_eager", True),
        max_model_len=request.get("max_model_len", 256),
        # vLLM's CPU backend reserves this share of the machine's memory (KV cache included)
        gpu_memory_utilization=request.get("gpu_memory_utilization", 0.1),
        seed=0,
    )
    startup = time.perf_counter() - start
    # greedy, to exactly max_tokens (the tiny tokenizers' EOS could otherwise end a row early)
    sampling = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    outputs = llm.generate(request["prompts"], sampling, use_tqdm=False)
    seconds = []
    for _ in range(request.get("repeats", 0)):
        start = time.perf_counter()
        llm.generate(request["prompts"], sampling, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    answer = {
        "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
        "prompt_token_ids": [list(output.prompt_token_ids) for output in outputs],
        "model_class": llm.llm_engine.model_config.architecture,
        "startup_seconds": startup,
        "generate_seconds": seconds,
    }
    with open(answer_path, "w") as file:
        json.dump(answer, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
