"""One truth about CUDA: the Dockerfile (which reads the torch wheel's metadata), the Makefile's GPU
install path, the README and the docs name the same torch wheel, CUDA version and minimum driver, and
no other."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA = re.compile(r"CUDA (\d+\.\d+)")
DRIVER = re.compile(r"driver (?:>= ?)?(\d{3})")
TORCH = re.compile(r"torch==(\d+\.\d+\.\d+)")


def the_dockerfiles_truth() -> tuple[str, str, str]:
    text = (ROOT / "Dockerfile").read_text()
    cuda = re.search(r"wheel is built for CUDA (\d+\.\d+)", text).group(1)
    driver = re.search(r"needs an NVIDIA driver >= (\d+)", text).group(1)
    torch = re.search(r'ARG TORCH_SPEC="torch==([\d.]+)"', text).group(1)
    # The metadata it quotes: the CUDA toolkit the wheel requires is that version.
    assert re.search(rf"cuda-toolkit\[[^\]]*\]=={re.escape(cuda)}\.\d+", text)
    return torch, cuda, driver


def disagreements(texts: dict[str, str], torch: str, cuda: str, driver: str) -> list[str]:
    found = []
    for name, text in texts.items():
        found += [f"{name}: torch=={v}" for v in TORCH.findall(text) if v != torch]
        found += [f"{name}: CUDA {v}" for v in CUDA.findall(text) if v != cuda]
        found += [f"{name}: driver {v}" for v in DRIVER.findall(text) if v != driver]
        found += [f"{name}: {url}" for url in re.findall(r"download\.pytorch\.org/whl/cu\d+", text)]
    return found


def documents() -> dict[str, str]:
    paths = [ROOT / "README.md", ROOT / "Makefile", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def test_the_makefile_readme_and_docs_name_the_dockerfiles_wheel_cuda_and_driver():
    torch, cuda, driver = the_dockerfiles_truth()
    assert (torch, cuda, driver) == ("2.13.0", "13.0", "580")
    texts = documents()
    assert disagreements(texts, torch, cuda, driver) == []
    makefile = texts["Makefile"]
    assert f"TORCH_SPEC ?= torch=={torch}\n" in makefile
    assert f"CUDA {cuda}" in makefile and f"driver {driver}" in makefile
    start = texts["docs/getting-started.md"]
    assert f"**CUDA {cuda}**" in start and f"**NVIDIA driver {driver} or newer**" in start
    assert f"`torch=={torch}` (PyPI's wheel, CUDA {cuda}): the default" in start
    assert f"CUDA {cuda} build" in texts["README.md"] and f"driver {driver} or newer" in texts["README.md"]


def test_another_cuda_version_or_a_cuda_index_is_a_disagreement():
    torch, cuda, driver = the_dockerfiles_truth()
    stale = {"README.md": "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 "
                          "(a driver for CUDA 12.8 or newer; driver 570)"}
    assert disagreements(stale, torch, cuda, driver) == [
        "README.md: CUDA 12.8", "README.md: driver 570", "README.md: download.pytorch.org/whl/cu128"]
