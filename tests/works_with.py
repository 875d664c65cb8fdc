"""The "Works with" table of the documentation (docs/integrations.md): which clients that transformers users bring
run on which variant, as the client tests found it. Nothing in the table is written by hand.

    python tests/works_with.py [FILES]    run the client tests (FILES, default all of them; slow ones included), then
                                          update works_with.json (the clients they recorded) and the page's table
    python tests/works_with.py --render   rewrite the page's table from works_with.json alone

A client test calls the `works_with` fixture (conftest.py) once it has checked a variant: `works_with(client,
variant)` when the real client gave the variant's own results, `works_with(client, variant, refused=reason)` when the
variant refused it up front, as the test asserted, and `works_with(client, variant, fails=reason)` where the client
ran and answered otherwise (a defect outside the zoo that the test xfails strictly; `test_works_with.py` lists the
ones allowed). The table is written only from a run in which every test passed.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

# what a refused variant can do instead, per client (shown after the reason), said where the refusals are decided
from hf_attn_zoo.models.clients_zoo import INSTEAD

TESTS = Path(__file__).resolve().parent
PAGE = TESTS.parent / "docs" / "integrations.md"  # the "Works with" section
RESULTS = TESTS / "works_with.json"
START, END = "<!-- works-with:start -->", "<!-- works-with:end -->"

# client key (what tests record) -> column heading; the columns' order
CLIENTS = {
    "trl": "TRL SFT packing / padding-free",
    "serve": "`hf-attn-zoo serve` (transformers' server)",
    "serve-cb": "serve, continuous batching",
    "executorch": "ExecuTorch static-cache export",
    "export": "`torch.export`, dynamic batch × length",
    "onnx": "ONNX in onnxruntime",
    "kvpress": "kvpress presses",
    "native": "native transformers export (`hf-attn-zoo export --to native`)",
    "llama_cpp": "llama.cpp (GGUF)",
    "vllm-native": "vLLM (native export)",
    "vllm-transformers": "vLLM (transformers backend)",
}
# the test files that record outcomes
CLIENT_TESTS = [
    "tests/test_clients.py",
    "tests/test_serving.py",
    "tests/test_export.py",
    "tests/test_floor.py",
    "tests/test_native_export.py",
    "tests/test_llama_cpp.py",
    "tests/test_vllm.py",
]


def render(results: dict[str, dict[str, str]]) -> str:
    """A markdown table, one row per variant, one column per client; refusals become footnotes with their reason."""
    variants = sorted({variant for outcomes in results.values() for variant in outcomes})
    clients = [client for client in CLIENTS if client in results]
    reasons: list[str] = []
    lines = ["| variant | " + " | ".join(CLIENTS[c] for c in clients) + " |", "|---" * (len(clients) + 1) + "|"]
    for variant in variants:
        cells = []
        for client in clients:
            outcome = results[client].get(variant, "not tested")
            kind, _, reason = outcome.partition(": ")
            if kind in ("refused", "fails"):
                if client in INSTEAD:
                    reason = f"{reason}; {INSTEAD[client]}"
                if reason not in reasons:
                    reasons.append(reason)
                outcome = f"{kind} [{reasons.index(reason) + 1}]"
            cells.append(outcome)
        lines.append(f"| `zoo_{variant}` | " + " | ".join(cells) + " |")
    lines += [""] + [f"- [{i}] {reason}" for i, reason in enumerate(reasons, 1)]
    return "\n".join(lines).rstrip() + "\n"


def page_table(page: str) -> str:
    """The table between the markers of the page."""
    if START not in page or END not in page:
        raise ValueError(f"{PAGE.name} has no {START} ... {END} section for the table")
    return page.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_page(results: dict[str, dict[str, str]]) -> None:
    page = PAGE.read_text()
    before, rest = page.split(START, 1)
    after = rest.split(END, 1)[1]
    PAGE.write_text(f"{before}{START}\n{render(results)}{END}{after}")


def main(argv: list[str]) -> int:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if argv[:1] != ["--render"]:
        with tempfile.TemporaryDirectory() as folder:
            recorded = Path(folder) / "works_with.json"
            command = [sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", *(argv or CLIENT_TESTS)]
            returncode = subprocess.call([*command, "--works-with", str(recorded)], cwd=TESTS.parent)
            if returncode != 0:
                print("some client tests failed; the table is left as it was", file=sys.stderr)
                return returncode
            # a client's column is replaced whole, so it never mixes two runs
            results.update(json.loads(recorded.read_text()))
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    write_page(results)
    print(f"wrote {RESULTS.relative_to(TESTS.parent)} and the table in {PAGE.relative_to(TESTS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
