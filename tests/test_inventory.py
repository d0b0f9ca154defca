"""Inventory validation: every mistake is one located line with a fix; the CLI exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from core.errors import InventoryError
from core.inventory import embedded_inventory, find_inventory, load_inventory, parse_inventory, parse_size

ROOT = Path(__file__).resolve().parent.parent

LOCAL = "cluster: lab\nnodes:\n  - name: a\n    kind: local\n"

BAD = {
    "yaml syntax": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n   rpc_port: 1\n",
                    "bad.yaml: line 5, column 4: YAML syntax error"),
    "unknown key": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    rpc_prot: 5000\n",
                    "bad.yaml:5: nodes[0] (x).rpc_prot: unknown key 'rpc_prot' (fix: did you mean 'rpc_port'?)"),
    "unknown top key": ("clustr: a\nnodes:\n  - name: x\n    kind: local\n",
                        "bad.yaml:1: clustr: unknown key 'clustr' (fix: did you mean 'cluster'?)"),
    "duplicate name": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n  - name: x\n    kind: local\n"
                       "    rpc_port: 5001\n", "bad.yaml:5: nodes[1].name: duplicate node name 'x' (also nodes[0])"),
    "port clash": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n  - name: y\n    kind: local\n",
                   "bad.yaml:5: nodes[1].rpc_port: port 50052 clashes with node 'x' on the same host"),
    "wrong type": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    rpc_port: abc\n",
                   "bad.yaml:5: nodes[0] (x).rpc_port: expected a whole number, got 'abc'"),
    "wrong type in defaults": ("cluster: a\ndefaults:\n  threads: two\nnodes:\n  - name: x\n    kind: local\n",
                               "bad.yaml:3: defaults.threads: expected a whole number, got 'two'"),
    "bad backend": ("cluster: a\nnodes:\n  - name: x\n    host: h\n    backend: cuda2\n",
                    "bad.yaml:5: nodes[0] (x).backend: got 'cuda2'"),
    "ssh without host": ("cluster: a\nnodes:\n  - name: x\n", "bad.yaml:3: nodes[0] (x): an ssh node needs 'host'"),
    "shell in a name": ("cluster: a\nnodes:\n  - name: \"x;touch /tmp/pwned\"\n    kind: local\n",
                        "is not a valid name"),
    "bad size": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    memory: lots\n",
                 "bad.yaml:5: nodes[0] (x).memory: 'lots' is not a size"),
    "no nodes": ("cluster: a\nnodes: []\n", "bad.yaml:2: nodes: needs a list with at least one node"),
    "not a mapping": ("- a\n- b\n", "bad.yaml: the inventory must be a mapping"),
    "empty": ("", "bad.yaml: the inventory is empty"),
    "port out of range": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    rpc_port: 70000\n",
                          "nodes[0] (x).rpc_port: 70000: input should be less than or equal to 65535"),
    "direct needs an ip": ("cluster: a\nnodes:\n  - name: x\n    host: pi.lan\n    transport: direct\n",
                           "bad.yaml:3: nodes[0] (x): transport: direct binds the worker to 'host'"),
    "api port clash": ("cluster: a\napi: {port: 50052}\nnodes:\n  - name: x\n    kind: local\n",
                       "nodes[0].rpc_port: port 50052 clashes with api.port"),
    "metrics port clash": ("cluster: a\nmetrics: {port: 50052}\nnodes:\n  - name: x\n    kind: local\n",
                           "nodes[0].rpc_port: port 50052 clashes with metrics.port"),
    "metrics on the api port": ("cluster: a\nmetrics: {port: 8080}\nnodes:\n  - name: x\n    kind: local\n",
                                "bad.yaml:2: metrics.port: port 8080 is also api.port"),
    "metrics port out of range": ("cluster: a\nmetrics: {port: -1}\nnodes:\n  - name: x\n    kind: local\n",
                                  "metrics.port: -1: input should be greater than or equal to 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inventory_is_one_located_line(case: str) -> None:
    text, expected = BAD[case]
    with pytest.raises(InventoryError) as caught:
        parse_inventory(text, "bad.yaml")
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("case", ["yaml syntax", "unknown key", "duplicate name", "port clash", "wrong type"])
def test_cli_exits_2_with_one_line_and_no_traceback(case: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD[case][0])
    result = CliRunner().invoke(app, ["-i", str(path), "up"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "Traceback" not in result.output


def test_missing_inventory_file_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["-i", str(tmp_path / "nope.yaml"), "status"])
    assert result.exit_code == 2
    assert "no such inventory file" in result.output


def test_defaults_apply_unless_the_node_overrides() -> None:
    inventory = parse_inventory(
        "cluster: lab\ndefaults:\n  user: llama\n  rpc_port: 6000\n  labels: {site: home}\n"
        "nodes:\n  - name: a\n    host: a.lan\n  - name: b\n    host: b.lan\n    user: me\n"
        "    labels: {gpu: '1'}\n", "inv.yaml")
    a, b = inventory.nodes
    assert (a.user, a.rpc_port, a.labels) == ("llama", 6000, {"site": "home"})
    assert (b.user, b.rpc_port, b.labels) == ("me", 6000, {"site": "home", "gpu": "1"})


def test_paths_resolve_against_the_inventory_folder(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(LOCAL + "model: models/m.gguf\n")
    assert load_inventory(path).model_path == tmp_path / "models" / "m.gguf"
    path.write_text(LOCAL + "model: ~/m.gguf\n")
    assert load_inventory(path).model_path == Path.home() / "m.gguf"


def test_example_inventory_is_valid_and_heterogeneous() -> None:
    inventory = load_inventory(ROOT / "inventory.example.yaml")
    backends = {node.backend for node in inventory.nodes}
    assert {"cuda", "rocm", "metal"} <= backends
    assert {node.kind for node in inventory.nodes} == {"ssh", "local"}
    pi = next(node for node in inventory.nodes if node.name == "pi5")
    assert pi.memory == 6 << 30 and pi.user == "llama"


def test_embedded_default_is_two_local_workers_and_the_demo_model() -> None:
    inventory = embedded_inventory()
    assert [node.kind for node in inventory.nodes] == ["local", "local"]
    assert inventory.model is None
    assert len({node.rpc_port for node in inventory.nodes}) == 2


def test_inventory_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GGML_CLUSTER_INVENTORY", raising=False)
    assert find_inventory(None) is None
    (tmp_path / "inventory.yaml").write_text(LOCAL)
    assert find_inventory(None) == Path("inventory.yaml")
    monkeypatch.setenv("GGML_CLUSTER_INVENTORY", "/x/env.yaml")
    assert find_inventory(None) == Path("/x/env.yaml")
    assert find_inventory("opt.yaml") == Path("opt.yaml")


@pytest.mark.parametrize(("text", "size"), [("6GiB", 6 << 30), ("512 MiB", 512 << 20), ("8GB", 8 * 10**9),
                                            (4096, 4096), ("1.5GiB", 3 << 29)])
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1", 0, True, "5 parsecs"])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)
