"""The patches on llama.cpp: found in name order, one digest (the Makefile's too), applied with zero fuzz or a
clear error naming the patch; the keys of every build carry them."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from core.errors import DeployError
from core.nodes import patches
from core.nodes.build import WORKER_TREE, build_key, pinned_version, project_name, worker_digest, worker_source
from core.nodes.patches import apply_patches, changed_paths, flavour, patch_files, patches_digest, patches_within

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "int threshold = 10;\nint other = 1;\nint third = 3;\n"


def write_patch(folder: Path, name: str, path: str, old: str, new: str) -> Path:
    """A unified diff of ``path`` from ``old`` to ``new``, relative to a llama.cpp-like root (a/…, b/…)."""
    (folder / "a").mkdir(parents=True, exist_ok=True)
    (folder / "b").mkdir(exist_ok=True)
    (folder / "a" / "f").write_text(old)
    (folder / "b" / "f").write_text(new)
    diff = subprocess.run(["diff", "-u", "--label", f"a/{path}", "--label", f"b/{path}", str(folder / "a" / "f"),
                           str(folder / "b" / "f")], capture_output=True, text=True, check=False).stdout
    patch = folder / name
    patch.write_text("Why this patch exists, in one line.\n\n" + diff)
    return patch


def fake_tree(root: Path) -> Path:
    (root / "ggml" / "src").mkdir(parents=True)
    (root / "ggml" / "src" / "rpc.cpp").write_text(SOURCE)
    return root


def test_the_patches_are_the_repositorys_in_name_order(tmp_path: Path) -> None:
    assert [path.name for path in patch_files()][:1] == ["0001-rpc-hash-threshold-1mib.patch"]
    for name in ("0010-c.patch", "0002-b.patch", "0001-a.patch", "notes.txt"):
        (tmp_path / name).write_text(name)
    assert [path.name for path in patch_files(tmp_path)] == ["0001-a.patch", "0002-b.patch", "0010-c.patch"]
    with pytest.raises(DeployError, match="no patches folder"):
        patch_files(tmp_path / "missing")


def test_the_digest_is_the_sha256_of_the_patches_in_order(tmp_path: Path) -> None:
    first, second = tmp_path / "0001-a.patch", tmp_path / "0002-b.patch"
    first.write_text("one\n")
    second.write_text("two\n")
    assert patches_digest([first, second]) == hashlib.sha256(b"one\ntwo\n").hexdigest()[:12]
    assert patches_digest([second, first]) != patches_digest([first, second])
    assert patches_digest([]) == hashlib.sha256(b"").hexdigest()[:12]


def test_the_makefile_computes_the_same_digest() -> None:
    rule = "print-patch-key:\n\t@echo $(PATCH_KEY)\n"
    printed = subprocess.run(["make", "-s", "-f", "Makefile", "-f", "-", "print-patch-key"], input=rule, cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert printed == patches_digest()


def test_keys_differ_by_flavour_and_by_the_patches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = worker_digest()
    assert project_name("0.3.36") == f"worker-0.3.36-p{digest}"
    assert project_name("0.3.36", stock=True) == "worker-0.3.36-stock"
    changed = tmp_path / "patches"
    changed.mkdir()
    for patch in patch_files():
        (changed / patch.name).write_bytes(patch.read_bytes() + b"\n")
    monkeypatch.setattr(patches, "PATCHES_DIR", changed)
    assert worker_digest() != digest and flavour(stock=True) == "stock"
    assert build_key("0.3.36", "vulkan", "Linux", "x86_64") == f"0.3.36-p{worker_digest()}-linux-x86_64-vulkan"


def test_a_patch_names_the_files_it_changes(tmp_path: Path) -> None:
    patch = write_patch(tmp_path, "0001-a.patch", "ggml/src/rpc.cpp", SOURCE, SOURCE.replace("10", "1"))
    assert changed_paths(patch) == ("ggml/src/rpc.cpp",)
    both = tmp_path / "0002-both.patch"
    both.write_text("Two files.\n\n--- a/src/llama-context.cpp\n+++ b/src/llama-context.cpp\n@@ -1 +1 @@\n-a\n+b\n"
                    "--- a/ggml/include/ggml-rpc.h\n+++ /dev/null\n@@ -1 +0,0 @@\n-c\n")
    assert changed_paths(both) == ("src/llama-context.cpp", "ggml/include/ggml-rpc.h")
    assert patches_within(WORKER_TREE, [patch, both]) == (patch, both)
    assert patches_within(("tools/rpc/rpc-server.cpp",), [patch, both]) == ()


def test_a_patch_on_llamas_own_sources_keys_the_coordinators_wheel_but_no_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA worker takes half an hour to build: a patch it does not compile must not throw it away.
    worker_key = build_key("0.3.36", "cuda", "Linux", "x86_64")
    wheel = patches_digest()
    changed = tmp_path / "patches"
    changed.mkdir()
    for patch in patch_files():
        (changed / patch.name).write_bytes(patch.read_bytes())
    (changed / "9999-llama-only.patch").write_text(
        "Changes llama's own sources only.\n\n--- a/src/llama-graph.cpp\n+++ b/src/llama-graph.cpp\n"
        "@@ -1 +1 @@\n-a\n+b\n")
    monkeypatch.setattr(patches, "PATCHES_DIR", changed)
    assert patches_digest() != wheel
    assert build_key("0.3.36", "cuda", "Linux", "x86_64") == worker_key
    assert all(not path.startswith("src/") for patch in patches_within(WORKER_TREE) for path in changed_paths(patch))


def test_patches_apply_in_order(tmp_path: Path) -> None:
    tree = fake_tree(tmp_path / "tree")
    middle = SOURCE.replace("10", "1")
    first = write_patch(tmp_path / "p1", "0001-a.patch", "ggml/src/rpc.cpp", SOURCE, middle)
    second = write_patch(tmp_path / "p2", "0002-b.patch", "ggml/src/rpc.cpp", middle,
                         middle.replace("other = 1", "other = 2"))
    apply_patches(tree, "0.3.36", [first, second])
    assert (tree / "ggml" / "src" / "rpc.cpp").read_text() == "int threshold = 1;\nint other = 2;\nint third = 3;\n"


def test_a_patch_that_no_longer_applies_is_an_error_naming_it(tmp_path: Path) -> None:
    tree = fake_tree(tmp_path / "tree")
    stale = write_patch(tmp_path / "p", "0002-stale.patch", "ggml/src/rpc.cpp",
                        SOURCE.replace("other = 1", "other = 9"), SOURCE.replace("other = 1", "other = 8"))
    with pytest.raises(DeployError) as caught:
        apply_patches(tree, "9.9.9", [stale])
    message = str(caught.value)
    assert "patches/0002-stale.patch does not apply to the llama.cpp of llama-cpp-python 9.9.9: error: patch failed" \
        in message
    assert "update patches/0002-stale.patch for the new source" in message and "\n" not in message
    assert (tree / "ggml" / "src" / "rpc.cpp").read_text() == SOURCE  # checked first: nothing half-applied


def test_a_patch_is_applied_with_zero_fuzz(tmp_path: Path) -> None:
    """A context line that changed is a failure, not a near match (GNU patch would apply it with fuzz 1)."""
    tree = fake_tree(tmp_path / "tree")
    (tree / "ggml" / "src" / "rpc.cpp").write_text(SOURCE.replace("third = 3", "third = 4"))
    patch = write_patch(tmp_path / "p", "0001-a.patch", "ggml/src/rpc.cpp", SOURCE,
                        SOURCE.replace("other = 1", "other = 2"))
    with pytest.raises(DeployError, match=r"0001-a\.patch does not apply"):
        apply_patches(tree, "0.3.36", [patch])


def test_include_limits_the_patches_to_a_partial_tree(tmp_path: Path) -> None:
    tree = fake_tree(tmp_path / "tree")
    ours = write_patch(tmp_path / "p1", "x", "ggml/src/rpc.cpp", SOURCE, SOURCE.replace("10", "1"))
    elsewhere = write_patch(tmp_path / "p2", "y", "src/llama.cpp", "a\n", "b\n")
    both = tmp_path / "0001-both.patch"
    both.write_text(ours.read_text() + elsewhere.read_text().split("\n\n", 1)[1])
    with pytest.raises(DeployError, match=r"0001-both\.patch does not apply"):
        apply_patches(tree, "0.3.36", [both])  # src/llama.cpp is not there
    apply_patches(tree, "0.3.36", [both], include=["ggml/*"])
    assert (tree / "ggml" / "src" / "rpc.cpp").read_text().startswith("int threshold = 1;")


def test_patches_apply_inside_a_git_checkout(tmp_path: Path) -> None:
    """git apply in a repository takes paths from its root: the tree's own paths must still be the ones patched."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = fake_tree(tmp_path / "deep" / "tree")
    patch = write_patch(tmp_path / "p", "0001-a.patch", "ggml/src/rpc.cpp", SOURCE, SOURCE.replace("10", "1"))
    apply_patches(tree, "0.3.36", [patch])
    assert (tree / "ggml" / "src" / "rpc.cpp").read_text().startswith("int threshold = 1;")


def test_without_git_the_error_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patches.shutil, "which", lambda _name: None)
    with pytest.raises(DeployError, match="git is not installed"):
        apply_patches(fake_tree(tmp_path / "tree"), "0.3.36", [])


def test_the_worker_source_is_patched_and_the_stock_one_is_not() -> None:
    version = pinned_version()
    patched = worker_source(version, lambda _message, _fraction: None)
    stock = worker_source(version, lambda _message, _fraction: None, stock=True)
    assert (patched.name, stock.name) == (project_name(version), project_name(version, stock=True))
    rpc = Path("ggml/src/ggml-rpc/ggml-rpc.cpp")
    assert "const size_t HASH_THRESHOLD = 1024 * 1024;" in (patched / rpc).read_text()
    assert "const size_t HASH_THRESHOLD = 10 * 1024 * 1024;" in (stock / rpc).read_text()
    assert (patched / "tools" / "rpc" / "rpc-server.cpp").is_file()
