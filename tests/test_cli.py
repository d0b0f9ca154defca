"""The command line itself, through the installed `ggml-cluster` script: where options may go, their help,
and bad usage (exit 2). Nothing here starts a worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from tests.harness import CLI, HEAVY

COMMANDS = {"up": [], "status": [], "run": ["Hello"], "check": [], "plan": [], "profile": [], "down": []}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=60, check=False)


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("cluster: lab\nnodes: []\n")
    return path


def refused(result: subprocess.CompletedProcess[str], path: Path) -> bool:
    """Exit 2 with one line naming the inventory file (no traceback)."""
    return (result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
            and result.stderr.startswith(f"error: {path}:2: nodes: needs a list with at least one node"))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_inventory_and_debug_options_work_after_the_command(command: str, bad: Path) -> None:
    result = cli(command, *COMMANDS[command], "-i", str(bad), cwd=bad.parent)
    assert refused(result, bad), result.stderr
    debug = cli(command, "--inventory", str(bad), *COMMANDS[command], "--debug", cwd=bad.parent)
    assert "Traceback" in debug.stderr and "InventoryError" in debug.stderr
    shown = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
    assert "--inventory" in shown and "-i" in shown and "--debug" in shown


def test_the_commands_inventory_wins_over_the_one_before_it_and_debug_works_before_it_too(bad: Path) -> None:
    assert refused(cli("-i", str(bad.parent / "other.yaml"), "up", "-i", str(bad), cwd=bad.parent), bad)
    assert refused(cli("-i", str(bad), "up", cwd=bad.parent), bad)
    debug = cli("--debug", "-i", str(bad), "up", cwd=bad.parent)
    assert "Traceback" in debug.stderr and "InventoryError" in debug.stderr


@pytest.mark.parametrize("interval", ["0", "0.05", "-1", "nan"])
def test_status_refuses_an_interval_below_a_tenth_of_a_second(interval: str, tmp_path: Path) -> None:
    """An interval of 0 would have the controller send snapshots as fast as it can."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("cluster: lab\nnodes:\n  - name: a\n    kind: local\n")
    result = subprocess.run([CLI, "status", "--watch", "--json", "--interval", interval, "-i", str(inventory)],
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "GGML_CLUSTER_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 2
    assert "--interval" in result.stderr and "0.1" in result.stderr


def test_the_commands_people_type_most_load_nothing_heavy(tmp_path: Path) -> None:
    """The CLI's own module and `status`'s code path, in a fresh interpreter: none of HEAVY is loaded."""
    probe = ("import sys, asyncio\nimport cli.app\nfrom core import client\nfrom core.state import StateDir\n"
             f"loaded = [name for name in {HEAVY!r} if name in sys.modules]\n"
             "try:\n    asyncio.run(client.status(StateDir(sys.argv[1])))\nexcept Exception:\n    pass\n"
             f"print(loaded + [name for name in {HEAVY!r} if name in sys.modules and name not in loaded])")
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "state")], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout
    loaded = subprocess.run([sys.executable, "-c", "import sys, cli.app, core.lifecycle\n"
                             f"print([name for name in {HEAVY!r} if name not in sys.modules])"],
                            capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout  # the names are real: the heavy path loads each
