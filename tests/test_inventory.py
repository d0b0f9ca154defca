"""Inventory validation: every mistake is one located line with a fix; the CLI exits 2."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli.app import app
from core.errors import InventoryError
from core.inventory import embedded_inventory, find_inventory, load_inventory, parse_inventory
from core.inventory_fields import parse_size

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
    "huge size": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    memory: " + "9" * 309 + "GiB\n",
                  "bad.yaml:5: nodes[0] (x).memory: '99999999"),
    "huge plain size": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    memory: " + "9" * 400 + "\n",
                        "bad.yaml:5: nodes[0] (x).memory: 99999999"),
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
    "env value not text": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    env: {CUDA_VISIBLE_DEVICES: 0}\n",
                           "bad.yaml:5: nodes[0] (x).env: CUDA_VISIBLE_DEVICES: expected text, got 0; quote it"),
    "env name": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    env: {1GPU: x}\n",
                 "bad.yaml:5: nodes[0] (x).env: '1GPU' is not an environment variable name: use letters, digits "
                 "and '_', not starting with a digit"),
    "env name with a shell character": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    env: {'A;B': x}\n",
                                        "nodes[0] (x).env: 'A;B' is not an environment variable name"),
    "env reserved": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    env: {LLAMA_CACHE: /tmp}\n",
                     "nodes[0] (x).env: LLAMA_CACHE is set by ggml-cluster (the worker's tensor cache); remove it"),
    "env newline": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    env: {A: \"1\\n2\"}\n",
                    "nodes[0] (x).env: A: '1\\n2' holds an unprintable character"),
    "env not a mapping": ("cluster: a\nnodes:\n  - name: x\n    kind: local\n    env: [A=1]\n",
                          "bad.yaml:5: nodes[0] (x).env: expected a mapping, got ['A=1']"),
    "env in defaults": ("cluster: a\ndefaults:\n  env: {A-B: x}\nnodes:\n  - name: x\n    kind: local\n",
                        "bad.yaml:3: defaults.env: 'A-B' is not an environment variable name"),
    "api beyond loopback without a key": ("cluster: a\napi: {host: 0.0.0.0}\nnodes:\n  - name: x\n    kind: local\n",
                                          "bad.yaml:2: api.host: '0.0.0.0' is beyond loopback and the API has no key"),
    "metrics beyond loopback without a key": ("cluster: a\nmetrics: {host: 192.168.1.5}\nnodes:\n  - name: x\n"
                                              "    kind: local\n", "bad.yaml:2: metrics.host: '192.168.1.5' is "
                                              "beyond loopback and there is no key for the metrics endpoint"),
    "missing key file": ("cluster: a\napi: {key_file: no-such.key}\nnodes:\n  - name: x\n    kind: local\n",
                         "bad.yaml:2: api.key_file: no such file "),
    "parallel out of range": ("cluster: a\napi: {parallel: 65}\nnodes:\n  - name: x\n    kind: local\n",
                              "bad.yaml:2: api.parallel: 65: input should be less than or equal to 64"),
    "no parallel slot": ("cluster: a\napi: {parallel: 0}\nnodes:\n  - name: x\n    kind: local\n",
                         "bad.yaml:2: api.parallel: 0: input should be greater than or equal to 1"),
    "parallel neither auto nor a number": ("cluster: a\napi: {parallel: many}\nnodes:\n  - name: x\n    kind: local\n",
                                           "bad.yaml:2: api.parallel: 'many' is neither 'auto' nor a whole number "
                                           "of slots (1 to 64)"),
    "parallel as a yes": ("cluster: a\napi: {parallel: true}\nnodes:\n  - name: x\n    kind: local\n",
                          "bad.yaml:2: api.parallel: True is neither 'auto' nor a whole number of slots (1 to 64)"),
    "negative queue": ("cluster: a\napi: {queue: -1}\nnodes:\n  - name: x\n    kind: local\n",
                       "bad.yaml:2: api.queue: -1: input should be greater than or equal to 0"),
    "misspelt chat format": ("cluster: a\nchat_template: gema\nnodes:\n  - name: x\n    kind: local\n",
                             "bad.yaml:2: chat_template: 'gema' is neither a built-in chat format nor a file "
                             "(fix: did you mean 'gemma'? Otherwise name one of llama-cpp-python's chat formats"),
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


@pytest.mark.parametrize("case", ["yaml syntax", "unknown key", "duplicate name", "port clash", "wrong type",
                                  "huge size", "api beyond loopback without a key", "missing key file"])
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


def test_speculative_off_written_plainly_turns_it_off() -> None:
    # YAML 1.1 reads a bare `off` as false: what a user types must still mean off, not an error.
    for written in ("off", "'off'", "false"):
        inventory = parse_inventory(f"cluster: lab\nspeculative: {written}\n" + LOCAL.split("\n", 1)[1], "inv.yaml")
        assert inventory.speculative == "off" and not inventory.speculates, written
    assert parse_inventory(LOCAL, "inv.yaml").speculates
    assert parse_inventory("cluster: lab\nspeculative: on\n" + LOCAL.split("\n", 1)[1], "inv.yaml").speculates


def test_defaults_apply_unless_the_node_overrides() -> None:
    inventory = parse_inventory(
        "cluster: lab\ndefaults:\n  user: llama\n  rpc_port: 6000\n  labels: {site: home}\n"
        "  env: {GGML_RPC_DEBUG: '1', CUDA_VISIBLE_DEVICES: '0'}\n"
        "nodes:\n  - name: a\n    host: a.lan\n  - name: b\n    host: b.lan\n    user: me\n"
        "    labels: {gpu: '1'}\n    env: {CUDA_VISIBLE_DEVICES: '1', GGML_RPC_FAULT_COMPUTE: ''}\n", "inv.yaml")
    a, b = inventory.nodes
    assert (a.user, a.rpc_port, a.labels) == ("llama", 6000, {"site": "home"})
    assert (b.user, b.rpc_port, b.labels) == ("me", 6000, {"site": "home", "gpu": "1"})
    assert a.env == {"GGML_RPC_DEBUG": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert b.env == {"GGML_RPC_DEBUG": "1", "CUDA_VISIBLE_DEVICES": "1", "GGML_RPC_FAULT_COMPUTE": ""}
    assert parse_inventory(LOCAL, "inv.yaml").nodes[0].env == {}


def test_paths_resolve_against_the_inventory_folder(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(LOCAL + "model: models/m.gguf\n")
    assert load_inventory(path).model_path == tmp_path / "models" / "m.gguf"
    path.write_text(LOCAL + "model: ~/m.gguf\n")
    assert load_inventory(path).model_path == Path.home() / "m.gguf"


def test_chat_template_names_a_built_in_format_or_a_jinja_file(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(LOCAL + "chat_template: gemma\n")
    inventory = load_inventory(path)
    assert (inventory.chat_format, inventory.chat_template_file) == ("gemma", None)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    path.write_text(LOCAL + "chat_template: templates/chat.jinja\n")
    inventory = load_inventory(path)
    assert (inventory.chat_format, inventory.chat_template_file) == (None, tmp_path / "templates" / "chat.jinja")
    path.write_text(LOCAL)
    assert (load_inventory(path).chat_format, load_inventory(path).chat_template_file) == (None, None)


@pytest.mark.parametrize(("content", "expected"), [
    ("{% for m in messages %}{{ m.content }}", "line 1 is not a Jinja template: Unexpected end of template"),
    (b"\xff\xfe{{ messages }}", "cannot read"),
    (b"{#" + b"x" * (1 << 20) + b"#}", "bytes: not a chat template"),
    (None, "is neither a built-in chat format nor a file"),  # a folder
])
def test_a_chat_template_file_that_cannot_be_used_is_one_located_line(tmp_path: Path, content: str | bytes | None,
                                                                       expected: str) -> None:
    template = tmp_path / "chat.jinja"
    if content is None:
        template.mkdir()
    elif isinstance(content, bytes):
        template.write_bytes(content)
    else:
        template.write_text(content)
    path = tmp_path / "inv.yaml"
    path.write_text(LOCAL + "chat_template: chat.jinja\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:5: chat_template: ") and expected in message
    assert "\n" not in message


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


def test_embedded_default_ports_are_outside_the_ephemeral_range() -> None:
    """An outgoing connection (or its TIME_WAIT) that the kernel gave the demo's port would keep a worker from
    binding it: the demo failed a node now and then when its ports lay in Linux's 32768-60999."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(not low <= node.rpc_port <= high for node in embedded_inventory().nodes)


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


@pytest.mark.parametrize("text", ["lots", "-1", 0, True, "5 parsecs", "0.1b", "0." + "0" * 100_000 + "1TB"],
                         ids=lambda text: str(text)[:12])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text", ["9" * 309, "9" * 309 + "GiB", "1" + "0" * 5000 + ".5 MiB", 10**400, (1 << 60) + 1,
                                  "1048577TiB", "2000000000000000000"], ids=lambda text: f"{str(text)[:12]}...")
def test_absurd_sizes_are_refused_by_a_clear_message(text: object) -> None:
    """More than 2**60 bytes (1 EiB) is a typo, not a machine; nothing overflows on the way."""
    with pytest.raises(ValueError, match=r"more than 1 EiB"):
        parse_size(text)


def test_sizes_are_exact_up_to_the_largest() -> None:
    assert parse_size("1048576TiB") == parse_size(1 << 60) == 1 << 60
    assert parse_size("1." + "0" * 100_000 + "GiB") == 1 << 30


# --- hostile input: any YAML is a valid inventory or one located line (exit 2); nothing shell-like survives -----

HOSTILE = [0, 70000, -1, "0",
           "a;touch /tmp/x", "$(id)", "`id`", "a b", "-oProxyCommand=id", "a\nb", "a\0b", "'", '"', "|", "&&", "\\",
           "%r", "~", "..", "*", "\t", "é", "x" * 300]
# Per field: values a user would write, so that many examples are valid; near misses come from HOSTILE.
FIELDS = {
    "kind": ["local", "ssh"], "host": ["127.0.0.1", "::1", "10.0.0.7"],
    "port": [22, 2222], "user": ["llama", "root", "svc_x-1"], "identity": ["~/.ssh/id_ed25519"],
    "rpc_port": [50052, 6000], "threads": [1, 4], "backend": ["auto", "cpu", "cuda", "metal"],
    "memory": ["6GiB", "512 MiB", 4096], "workdir": ["~/work", "/srv/a b"], "transport": ["ssh", "direct"],
    "build": ["auto", "remote", "push", {"path": "/opt/bin/ggml-rpc-server"}], "host_key": ["strict", "accept-new"],
    "labels": [{"site": "home"}, {"gpu": "1", "note": "a;b"}],
    "env": [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"GGML_RPC_DEBUG": "1", "_X": "a;b $(c)"}],
    "name": ["a", "b-1"],
}
TOP = {"context": [512, 2048], "watchdog": [60, 1], "strategy": ["compute", "memory", "equal"],
       "objective": ["latency", "throughput"], "api": [{"port": 0}, {"host": "127.0.0.1", "port": 8081}],
       "metrics": [{"enabled": False}, {"port": 9465}], "model": ["m.gguf", "~/models/x.gguf"]}
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
           | st.sampled_from(HOSTILE))
keys = st.sampled_from([*FIELDS, *TOP, "name", "cluster", "nodes", "path"]) | st.text(max_size=8)
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4),
                     max_leaves=12)


def field(values: list[object]) -> st.SearchStrategy[object]:
    """Mostly a plausible value; one in ten a hostile or arbitrary one."""
    return mostly(st.sampled_from(values), scalars | trees)


def mostly(usual: st.SearchStrategy[object], odd: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.integers(0, 9).flatmap(lambda roll: usual if roll else odd)


def fields(choices: dict[str, list[object]]) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={key: field(values) for key, values in choices.items()})


def numbered(index_and_node: tuple[int, dict]) -> dict:
    index, node = index_and_node
    return {"name": f"n{index}", "host": "127.0.0.1", "rpc_port": 50100 + index, **node}


nodes = st.lists(mostly(fields(FIELDS), trees), min_size=1, max_size=3).map(
    lambda listed: [numbered(pair) if isinstance(pair[1], dict) else pair[1] for pair in enumerate(listed)])
inventories = st.fixed_dictionaries(
    {"cluster": field(["lab", "home.gpu"]), "nodes": mostly(nodes, trees)},
    optional={"defaults": fields({key: values for key, values in FIELDS.items() if key not in ("host", "name")}),
              **{key: field(values) for key, values in TOP.items()}})
SHELL_SAFE = re.compile(r"[A-Za-z0-9_.:%-]*")


def _assert_valid_or_one_located_line(text: str) -> None:
    try:
        inventory = parse_inventory(text, "fuzz.yaml")
    except InventoryError as exc:
        message = str(exc)
        assert message.startswith("fuzz.yaml") and "\n" not in message and len(message) < 600, message
        assert exc.exit_code == 2
        return
    for node in inventory.nodes:  # what survives into ssh's username and host name is plain
        assert SHELL_SAFE.fullmatch(node.user or "") and SHELL_SAFE.fullmatch(node.host), node
        assert not node.host.startswith("-") and not (node.user or "").startswith("-")
        assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and value.isprintable()
                   for name, value in node.env.items()), node


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inventories)
def test_any_inventory_tree_loads_or_is_one_located_line(tree: object) -> None:
    _assert_valid_or_one_located_line(yaml.safe_dump(tree, allow_unicode=True))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200)
       | st.builds(lambda cut, noise: LOCAL_SSH[:cut] + noise + LOCAL_SSH[cut:],
                   st.integers(0, 200), st.text(alphabet=":-[]{}&*!|>'\"%@`#,? \n\t", max_size=6)))
def test_any_text_loads_or_is_one_located_line(text: str) -> None:
    _assert_valid_or_one_located_line(text)


LOCAL_SSH = ("cluster: lab\ndefaults: {workdir: ~/w, labels: {site: home}}\nnodes:\n  - name: a\n    kind: local\n"
             "  - name: b\n    host: 10.0.0.2\n    user: llama\n    build: {path: /opt/ggml-rpc-server}\n")


@pytest.mark.parametrize("text", [
    "[" * 5000,                                                  # deeper than the YAML composer recurses
    "a: &a [*a]\ncluster: *a\nnodes: *a\n",                      # a cycle
    "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(       # a billion laughs, shown in a line
        f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}]\n"
        for i in range(1, 9)) + "cluster: *l8\nnodes: *l8\n",
    "---\na: 1\n---\nb: 2\n",                                   # two documents
    'cluster: a\nnodes:\n  - {name: a, kind: local, "x\\ny": 1}\n',  # a key that would break the line
])
def test_pathological_yaml_is_one_located_line(text: str) -> None:
    with pytest.raises(InventoryError) as caught:
        parse_inventory(text, "bad.yaml")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 600


@pytest.mark.parametrize(("value", "expected"), [
    ("9" * 5000, "bad.yaml:5: '99999"),                      # past the digits Python's int() reads
    ("0x" + "f" * 5000, "bad.yaml:5: nodes[0] (a).memory: "),  # read (a power-of-two base), too long to print
    ("2020-13-45", "bad.yaml:5: '2020-13-45' is not a valid date (month must be in 1..12)"),
])
def test_a_value_yaml_cannot_construct_or_print_is_one_located_line(value: str, expected: str) -> None:
    with pytest.raises(InventoryError) as caught:
        parse_inventory(f"cluster: a\nnodes:\n  - name: a\n    kind: local\n    memory: {value}\n", "bad.yaml")
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
    assert len(str(caught.value)) < 300


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("user", "root;id", "'root;id' is not a user name"),
    ("user", "-oProxyCommand=id", "is not a user name"),
    ("host", "h$(id)", "is not a host name or address"),
    ("host", "-oProxyCommand=id", "is not a host name or address"),
    ("workdir", "a\0b", "a path cannot contain a NUL character"),
])
def test_fields_that_reach_ssh_reject_shell_characters(field: str, value: str, expected: str) -> None:
    text = yaml.safe_dump({"cluster": "a", "nodes": [{"name": "x", "host": "h", field: value}]})
    with pytest.raises(InventoryError) as caught:
        parse_inventory(text, "bad.yaml")
    assert f"nodes[0] (x).{field}: " in str(caught.value) and expected in str(caught.value)


def test_plain_users_hosts_and_odd_paths_are_accepted() -> None:
    inventory = parse_inventory(yaml.safe_dump({"cluster": "a", "nodes": [
        {"name": "x", "host": "fe80::1%eth0", "user": "svc_llama-2", "workdir": "/srv/a b;$(c)",
         "labels": {"note": "a;b $(c)"}},
        {"name": "y", "host": "gpu-box.lan", "user": "u.x"}]}), "ok.yaml")
    assert inventory.nodes[0].workdir == "/srv/a b;$(c)"  # paths are quoted on the node, never run


KEY = "0123456789abcdef-key"


def keyed(tmp_path: Path, api: str, content: str | bytes | None = KEY + "\n", mode: int = 0o600) -> Path:
    """An inventory at tmp_path/inv.yaml with ``api: {api}`` and a key file ``api.key`` beside it."""
    key = tmp_path / "api.key"
    if content is not None:
        key.write_bytes(content if isinstance(content, bytes) else content.encode())
        key.chmod(mode)
    path = tmp_path / "inv.yaml"
    path.write_text(f"cluster: lab\napi: {api}\nnodes:\n  - name: a\n    kind: local\n")
    return path


def refusal(path: Path) -> str:
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
    return str(caught.value)


def test_the_key_file_is_read_relative_to_the_inventory_and_never_dumped(tmp_path: Path) -> None:
    inventory = load_inventory(keyed(tmp_path, "{host: 0.0.0.0, key_file: api.key}"))
    assert inventory.api_key == KEY  # the file's trailing newline is not part of it
    assert inventory.api.key_file == "api.key"
    # What `up` writes to the state dir, what a repr or a log line would show: the file's name, never the key.
    assert KEY not in json.dumps(inventory.model_dump(mode="json")) and KEY not in repr(inventory)
    with pytest.raises(InventoryError, match="unknown key '_api_key'"):
        parse_inventory("cluster: a\n_api_key: x\nnodes:\n  - name: x\n    kind: local\n", "inv.yaml")


@pytest.mark.parametrize(("content", "mode", "expected"), [
    ("", 0o600, "api.key_file: {key} is empty"),
    ("  \n", 0o600, "api.key_file: {key} is empty"),
    (KEY, 0o640, "api.key_file: {key} is open to group or others (mode 0640) (fix: chmod 600 {key})"),
    (KEY, 0o604, "api.key_file: {key} is open to group or others (mode 0604)"),
    (KEY, 0o620, "(mode 0620)"),  # writable by the group: someone else could put in a key of their own
    ("short", 0o600, "api.key_file: {key} holds 5 characters: a key needs at least 16"),
    ("with a space in it", 0o600, "{key} holds a space, a control or a non-ASCII character"),
    ("clé-0123456789abcdef".encode(), 0o600, "{key} holds a character that is not ASCII"),
    ("x" * 5000, 0o600, "{key} has 5000 bytes: not an API key"),
])
def test_a_key_file_that_cannot_be_used_is_refused_naming_file_and_field(tmp_path: Path, content: str | bytes,
                                                                        mode: int, expected: str) -> None:
    message = refusal(keyed(tmp_path, "{key_file: api.key}", content, mode))
    assert message.startswith(f"{tmp_path / 'inv.yaml'}:2: ")
    assert expected.format(key=tmp_path / "api.key") in message
    assert KEY not in message  # a refused key is not shown either


def test_a_key_file_that_is_missing_a_folder_or_unreadable_is_refused(tmp_path: Path) -> None:
    assert f"api.key_file: no such file {tmp_path / 'api.key'} (fix: generate one" in refusal(
        keyed(tmp_path, "{key_file: api.key}", None))
    (tmp_path / "folder").mkdir()
    assert f"api.key_file: {tmp_path / 'folder'} is not a file" in refusal(keyed(tmp_path, "{key_file: folder}"))
    if os.geteuid() != 0:  # root reads any file
        assert f"api.key_file: cannot read {tmp_path / 'api.key'}: Permission denied" in refusal(
            keyed(tmp_path, "{key_file: api.key}", KEY, 0o200))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "LOCALHOST"])
def test_loopback_needs_no_key(tmp_path: Path, host: str) -> None:
    inventory = load_inventory(keyed(tmp_path, f"{{host: '{host}'}}", None))
    assert inventory.api_key is None and inventory.api.host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.5", "my-desktop.lan", "::ffff:8.8.8.8"])
def test_beyond_loopback_needs_a_key_and_says_how_to_give_one(tmp_path: Path, host: str) -> None:
    message = refusal(keyed(tmp_path, f"{{host: '{host}'}}", None))
    assert f"inv.yaml:2: api.host: {host!r} is beyond loopback and the API has no key" in message
    assert "fix: set api.key_file to a file that holds a key (chmod 600), or $GGML_CLUSTER_API_KEY; or set " \
           "api.host: 127.0.0.1" in message
    assert load_inventory(keyed(tmp_path, f"{{host: '{host}', key_file: api.key}}")).api_key == KEY


def test_the_metrics_endpoint_follows_the_same_rule(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    (tmp_path / "api.key").write_text(KEY)
    (tmp_path / "api.key").chmod(0o600)
    body = "nodes:\n  - name: a\n    kind: local\n"
    path.write_text("cluster: lab\nmetrics: {host: 0.0.0.0, port: 9464}\n" + body)
    assert "metrics.host: '0.0.0.0' is beyond loopback" in refusal(path)
    path.write_text("cluster: lab\nmetrics: {host: 0.0.0.0, enabled: false}\n" + body)
    assert load_inventory(path).api_key is None  # off: nothing listens
    path.write_text("cluster: lab\napi: {key_file: api.key}\nmetrics: {host: 0.0.0.0}\n" + body)
    assert load_inventory(path).api_key == KEY


def test_the_key_may_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_CLUSTER_API_KEY", KEY)
    assert load_inventory(keyed(tmp_path, "{host: 0.0.0.0}", None)).api_key == KEY
    assert embedded_inventory().api_key == KEY
    other = "another-key-0123456789"
    assert load_inventory(keyed(tmp_path, "{key_file: api.key}", other)).api_key == other  # the file wins
    for bad, expected in (("", "$GGML_CLUSTER_API_KEY is empty"), ("tiny", "$GGML_CLUSTER_API_KEY holds 4 "
                                                                          "characters: a key needs at least 16")):
        monkeypatch.setenv("GGML_CLUSTER_API_KEY", bad)
        message = refusal(keyed(tmp_path, "{}", None))  # on loopback too: set but unusable is a mistake
        assert expected in message and "or unset $GGML_CLUSTER_API_KEY" in message


def test_queue_and_parallel_defaults_and_bounds() -> None:
    api = parse_inventory(LOCAL, "inv.yaml").api
    assert (api.queue, api.parallel, api.key_file) == (16, "auto", None)  # auto: chosen with the plan
    api = parse_inventory(LOCAL + "api: {queue: 0, parallel: 64}\n", "inv.yaml").api
    assert (api.queue, api.parallel) == (0, 64)  # 0: nobody waits
    assert parse_inventory(LOCAL + "api: {parallel: 1}\n", "inv.yaml").api.parallel == 1  # today's one slot
    assert parse_inventory(LOCAL + "api: {parallel: auto}\n", "inv.yaml").api.parallel == "auto"
