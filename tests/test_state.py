"""The state directory: ggml-cluster makes its own folders private and leaves the user's folders as they are."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from core.errors import ClusterError
from core.inventory import load_inventory
from core.state import StateDir, fingerprint, read_launch


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_folders_it_creates_are_private_missing_parents_included(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    root = tmp_path / "state" / "ggml-cluster" / "lab"
    StateDir(root).create()
    assert [mode(folder) for folder in (tmp_path / "state", root.parent, root)] == [0o700] * 3
    assert mode(tmp_path) == 0o755


@pytest.mark.parametrize("existing", [0o1777, 0o755, 0o750])
def test_an_existing_folder_keeps_its_mode(tmp_path: Path, existing: int) -> None:
    """$GGML_CLUSTER_STATE_DIR=/tmp must not make /tmp private to one user."""
    tmp_path.chmod(existing)
    StateDir(tmp_path).create()
    assert mode(tmp_path) == existing


def test_a_state_dir_that_cannot_be_made_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("")
    with pytest.raises(ClusterError, match=r"cannot create the state dir .*a file/state: .*GGML_CLUSTER_STATE_DIR"):
        StateDir(tmp_path / "a file" / "state").create()


def test_the_controller_resolves_the_inventorys_paths_from_the_inventorys_folder(tmp_path: Path) -> None:
    """It reads the copy `up` wrote into the state dir; a relative chat_template is still the user's file."""
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "chat.jinja").write_text("{{ messages }}")
    path = tmp_path / "inv" / "inventory.yaml"
    path.write_text("cluster: lab\nchat_template: chat.jinja\nnodes:\n  - {name: a, kind: local}\n")
    inventory = load_inventory(path)
    state = StateDir(tmp_path / "state")
    state.create()
    state.inventory.write_text(json.dumps(inventory.model_dump(mode="json", exclude={"source"})))
    state.launch.write_text(json.dumps({"binary": "w", "model": "m.gguf", "protocol": [7, 0, 0],
                                        "source": inventory.location}))
    read, _ = read_launch(state)
    assert read.chat_template_file == tmp_path / "inv" / "chat.jinja" == inventory.chat_template_file


def test_a_new_api_key_is_a_new_fingerprint_though_no_file_holds_it(tmp_path: Path) -> None:
    """`up` with a rotated key must restart the API, not find the cluster unchanged and keep the old key."""
    state = StateDir(tmp_path).create()
    state.inventory.write_text('{"api": {"key_file": "api.key"}}')
    state.launch.write_text("{}")
    keys = [None, "0123456789abcdef-one", "0123456789abcdef-two"]
    assert len({state.fingerprint(key) for key in keys}) == 3
    assert state.fingerprint(keys[1]) == fingerprint(state.inventory.read_text(), "{}", keys[1])  # what `up` computes
    assert not any(key in path.read_text() for key in keys[1:] for path in tmp_path.iterdir() if path.is_file())
