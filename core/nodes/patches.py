"""The patches ggml-cluster carries on the vendored llama.cpp: ``patches/NNNN-name.patch`` at the repository root.

Unified diffs relative to the llama.cpp root (``a/ggml/...``, applied with -p1), in name order, with zero fuzz
(git apply never uses any). Their digest is part of every cache key, so a changed patch never reuses a build
made without it; the Makefile computes the same digest for the coordinator's wheel
(``cat $(sort $(wildcard patches/*.patch)) | sha256sum | cut -c1-12``). A build of part of llama.cpp (the
worker: ggml and rpc-server) is keyed by the digest of the patches that change its files alone, so a patch on
llama's own sources rebuilds the coordinator's wheel but none of the workers (a CUDA worker takes half an hour).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from core.errors import DeployError

# core/nodes/patches.py → the repository root: ggml-cluster is installed editable, from its checkout.
PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"
DIGEST_CHARS = 12
STOCK = "stock"


def patch_files(folder: Path | None = None) -> tuple[Path, ...]:
    """The patch files in the order they apply (by name), from ``folder`` (default: the repository's)."""
    folder = folder or PATCHES_DIR
    if not folder.is_dir():
        raise DeployError(f"no patches folder at {folder}",
                          "fix: run ggml-cluster from its source checkout (`make setup` installs it editable)")
    return tuple(sorted(folder.glob("*.patch"), key=lambda path: path.name))


def changed_paths(patch: Path) -> tuple[str, ...]:
    """The llama.cpp paths a patch changes, from its ``+++ b/PATH`` headers (``--- a/PATH`` for a deletion)."""
    paths: list[str] = []
    for line in patch.read_text(errors="replace").splitlines():
        match = re.match(r"(?:\+\+\+ b|--- a)/(\S+)", line)
        if match and match.group(1) not in paths:
            paths.append(match.group(1))
    return tuple(paths)


def patches_within(tree: Sequence[str], patches: Sequence[Path] | None = None) -> tuple[Path, ...]:
    """The patches (default: the repository's) that change a file of ``tree``: folders end in ``/``."""
    def inside(path: str) -> bool:
        return any(path.startswith(part) if part.endswith("/") else path == part for part in tree)
    return tuple(patch for patch in (patch_files() if patches is None else patches)
                 if any(inside(path) for path in changed_paths(patch)))


def patches_digest(patches: Sequence[Path] | None = None) -> str:
    """The first 12 hex digits of the sha256 of the patch files' bytes, concatenated in order."""
    digest = hashlib.sha256()
    for patch in patch_files() if patches is None else patches:
        digest.update(patch.read_bytes())
    return digest.hexdigest()[:DIGEST_CHARS]


def flavour(*, stock: bool = False, tree: Sequence[str] | None = None) -> str:
    """What a build's source is, for its cache keys: ``p<digest>`` (patched) or ``stock`` (llama.cpp as shipped).

    ``tree``: the paths a partial build holds (folders end in ``/``); only the patches that change them count.
    """
    if stock:
        return STOCK
    return f"p{patches_digest(None if tree is None else patches_within(tree))}"


def apply_patches(tree: Path, version: str, patches: Sequence[Path] | None = None,
                  include: Sequence[str] = ()) -> None:
    """Apply the patches to ``tree`` (a llama.cpp root, or a part of one with the same paths), each checked first.

    ``include``: path patterns (git apply --include) that limit the patches to the files a partial tree holds;
    hunks for other files are skipped. A patch that does not apply raises DeployError naming it: a new
    llama-cpp-python must never build without it silently.
    """
    if shutil.which("git") is None:
        raise DeployError("git is not installed on this machine; it applies the patches on llama.cpp",
                          "fix: apt-get install git (or your OS's package of git)")
    # Outside any repository git apply is a plain patch tool. Inside one it would take paths relative to that
    # repository's root, so discovery stops at the tree and inherited GIT_DIR/GIT_WORK_TREE are dropped.
    env = {key: value for key, value in os.environ.items() if key not in ("GIT_DIR", "GIT_WORK_TREE")}
    env["GIT_CEILING_DIRECTORIES"] = str(tree.resolve().parent)
    options = ["-p1", "--whitespace=nowarn", *(f"--include={pattern}" for pattern in include)]
    for patch in patch_files() if patches is None else patches:
        for check in (["--check"], []):
            result = subprocess.run(["git", "apply", *check, *options, str(patch.resolve())], cwd=tree, env=env,
                                    capture_output=True, text=True, check=False)
            if result.returncode != 0:
                complaint = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[0]
                raise DeployError(f"patches/{patch.name} does not apply to the llama.cpp of llama-cpp-python "
                                  f"{version}: {complaint}",
                                  f"fix: the patch no longer applies to llama-cpp-python {version}: "
                                  f"update patches/{patch.name} for the new source")
