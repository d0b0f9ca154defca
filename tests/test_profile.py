"""Node profiles: the cut model, the fits from timed runs, the cache (pure or file-only; no workers)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from core.engine.profile import (
    NodeProfile,
    ProfileCache,
    cut_model,
    fit_node,
    fit_overhead,
    model_fingerprint,
    node_speed,
    profile_key,
)
from core.engine.timing import difference_error, time_runs
from core.errors import ProfileError
from core.model import ModelFacts, read_model, write_demo_model
from core.planner import NodeCapacity, depths_for, plan_compute

MIB = 1 << 20


def facts(n_layers: int = 8, layer: int = 10 * MIB, output: int = 2 * MIB) -> ModelFacts:
    return ModelFacts(path=Path("m.gguf"), name="m.gguf", architecture="llama", n_layers=n_layers, n_embd=64,
                      layer_bytes=(layer,) * n_layers, output_bytes=output, input_bytes=MIB,
                      kv_bytes_per_token_layer=0)


def test_cut_model_keeps_the_first_layers_and_everything_else(tmp_path: Path) -> None:
    source = write_demo_model(tmp_path / "demo.gguf", n_layers=4)
    full = read_model(source)
    cut = read_model(cut_model(source, 2, tmp_path / "cut"))
    assert cut.n_layers == 2
    assert cut.layer_bytes == full.layer_bytes[:2]
    assert (cut.output_bytes, cut.input_bytes, cut.kv_bytes_per_token_layer) == (
        full.output_bytes, full.input_bytes, full.kv_bytes_per_token_layer)
    assert cut_model(source, 2, tmp_path / "cut") == cut.path  # written once
    assert not list((tmp_path / "cut").glob(".*partial"))


def test_cut_model_that_cannot_be_written_is_a_profile_error(tmp_path: Path) -> None:
    source = write_demo_model(tmp_path / "demo.gguf", n_layers=2)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ProfileError, match=r"cannot write a cut copy of demo.gguf .*fix: free disk space"):
        cut_model(source, 1, tmp_path / "file" / "cut")


def test_cut_model_loads_in_llama_cpp(tmp_path: Path) -> None:
    import llama_cpp

    source = write_demo_model(tmp_path / "demo.gguf", n_layers=4)
    llm = llama_cpp.Llama(model_path=str(cut_model(source, 1, tmp_path)), n_ctx=64, verbose=False)
    try:
        assert llm.n_vocab() > 300
        llm.eval(llm.tokenize(b"the cluster"))
    finally:
        llm.close()


def test_fit_node_separates_fixed_cost_layers_and_output() -> None:
    model = facts()
    # A step without logits: 2 ms (fixed). Whole tokens: 1.5 ms per 10 MiB layer and a 0.2 ms output layer on
    # top: 3.7 ms with one layer, 6.7 ms with three.
    profile = fit_node(model, (0.0037, 0.0067), (0.002, 0.0021), (1, 3), 40)
    assert profile.fixed_s == pytest.approx(0.002)
    assert profile.seconds_per_byte * 10 * MIB == pytest.approx(0.0015)
    assert profile.output_s == pytest.approx(0.0002)


def test_a_slope_lost_in_noise_is_charged_what_the_noise_could_hide() -> None:
    model = facts()
    # The three-layer layout timed faster than the one-layer one, within the noise (standard error 0.5 ms): the
    # two layers cost no more than the 1 ms the noise could hide.
    profile = fit_node(model, (0.0075, 0.0074), (0.002, 0.002), (1, 3), 40, difference_se=0.0005)
    assert profile.seconds_per_byte * 10 * MIB == pytest.approx(0.0005)
    assert profile.output_s == pytest.approx(0.005)
    # A noise larger than the whole token: no more than the token's bytes at one rate (5.5 ms over 10 + 2 MiB).
    profile = fit_node(model, (0.0075, 0.0074), (0.002, 0.002), (1, 3), 40, difference_se=0.01)
    assert profile.seconds_per_byte * 12 * MIB == pytest.approx(0.0055)


def test_a_resolved_slope_keeps_the_links_cost_off_the_layers() -> None:
    model = facts()
    # 1 ms per 10 MiB layer, measured well (the depths' difference stands 20x out of its noise), and an output
    # step that also waits 20 ms for what crosses a slow link. The link is the output layer's cost, not the
    # layers': the bytes' floor (22 ms over 12 MiB) would make every layer cost 18 ms.
    profile = fit_node(model, (0.023, 0.025), (0.001, 0.001), (1, 3), 64, difference_se=0.0001)
    assert profile.seconds_per_byte * 10 * MIB == pytest.approx(0.001)
    assert profile.output_s == pytest.approx(0.021)


def test_the_links_round_trip_is_a_fixed_cost_not_the_output_layers() -> None:
    model = facts()
    # A node 20 ms away: every token waits that once on it, for its output or for the next node's input, while
    # the step without logits never waits on it (llama.cpp reads nothing back). Its whole tokens hold it.
    near = fit_node(model, (0.0037, 0.0067), (0.002, 0.002), (1, 3), 40, round_trip_s=0.0)
    far = fit_node(model, (0.0237, 0.0267), (0.002, 0.002), (1, 3), 40, round_trip_s=0.02)
    assert far.fixed_s == pytest.approx(near.fixed_s + 0.02)
    assert far.output_s == pytest.approx(near.output_s)
    assert far.seconds_per_byte == pytest.approx(near.seconds_per_byte)


def test_a_slope_within_its_noise_is_charged_the_noise_not_the_links_wait() -> None:
    model = facts()
    # The same times, but the 2 ms difference is within twice its standard error (3 ms): the layers cost no more
    # than that, and still not the link's 20 ms.
    profile = fit_node(model, (0.023, 0.025), (0.001, 0.001), (1, 3), 64, difference_se=0.0015)
    assert profile.seconds_per_byte * 10 * MIB == pytest.approx(0.0015)


def test_the_coordinators_share_is_no_more_than_a_nodes_step_without_its_link() -> None:
    model = facts(n_layers=18, layer=MIB, output=40 * MIB)
    # Two nodes 6.5 ms away, each step 4 ms without its link. Timed together they ran 7 ms faster than timed
    # alone, less one output layer: the output layers' noise (one timed at 52 ms, the other at 45) says the
    # coordinator's share is 7 ms, more than the 4 ms step it is part of.
    a = fit_node(model, (0.062, 0.066), (0.004, 0.004), (1, 12), 64, difference_se=0.0003, round_trip_s=0.0065)
    b = fit_node(model, (0.055, 0.059), (0.004, 0.004), (1, 12), 64, difference_se=0.0003, round_trip_s=0.0065)
    layer = a.seconds_per_byte * MIB
    pair = a.fixed_s + b.fixed_s + 2 * layer + b.output_s - 0.007
    assert fit_overhead(model, a, b, pair, 1) == pytest.approx(0.004)
    # So a boundary still costs each node its link, and the plan does not split the model for the noise.
    for profile in (a, b):
        assert node_speed(model, profile, 0.004).fixed_s == pytest.approx(0.0065)
    plan = plan_compute(model, [NodeCapacity("a", 1 << 30), NodeCapacity("b", 1 << 30)],
                        [node_speed(model, profile, 0.004) for profile in (a, b)], 64)
    assert plan.layers == (None, (0, 17))  # the faster output layer's node alone


def test_the_depths_difference_is_as_sure_as_its_paired_tokens() -> None:
    # Drift that hits both layouts alike cancels out of each pair: only the pairs' own spread counts.
    first = [0.010, 0.020, 0.030, 0.040]
    assert difference_error(first, [value + 0.002 for value in first]) == pytest.approx(0.0)
    # differences 1, 3, 1, 3 ms: a standard deviation of 1.15 ms, over the root of 4 pairs
    assert difference_error(first, [0.011, 0.023, 0.031, 0.043]) == pytest.approx(0.001 / math.sqrt(3))
    assert difference_error([0.01], [0.02]) == 0.0


class Steps:
    """A layout's steps as the timing child takes them, each timed as its position in the whole sequence."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def step(self, out: object) -> float:
        self.log.append(f"{self.name}:whole")
        return float(len(self.log))

    def quiet_step(self) -> float:
        self.log.append(f"{self.name}:quiet")
        return float(len(self.log))


def test_steps_are_timed_in_runs_that_keep_their_graph() -> None:
    log: list[str] = []
    runs = [Steps("a", log), Steps("b", log)]
    steps, quiet = time_runs(runs, 2, 5, None, run_length=3)  # type: ignore[arg-type]
    # Warm-up first; then each layout in turn, three steps of each kind led by one untimed step (the graph sent
    # whole), and the last run shorter.
    round_ = ["whole"] * 4 + ["quiet"] * 4
    assert log == ["a:whole"] * 2 + ["b:whole"] * 2 + [f"a:{kind}" for kind in round_] + [
        f"b:{kind}" for kind in round_] + [f"a:{kind}" for kind in ["whole"] * 3 + ["quiet"] * 3] + [
        f"b:{kind}" for kind in ["whole"] * 3 + ["quiet"] * 3]
    assert steps == [[6, 7, 8, 22, 23], [14, 15, 16, 28, 29]]
    assert quiet == [[10, 11, 12, 25, 26], [18, 19, 20, 31, 32]]


def test_fit_node_with_one_depth_charges_the_token_by_bytes() -> None:
    profile = fit_node(facts(n_layers=1), (0.005, 0.005), (0.002, 0.002), (1, 1), 40)
    assert profile.fixed_s == pytest.approx(0.002)
    assert profile.seconds_per_byte * 12 * MIB == pytest.approx(0.003)
    assert profile.output_s == pytest.approx(0.0005)


def test_overhead_is_what_two_nodes_alone_count_twice() -> None:
    model = facts()
    # Each node alone: 1 ms coordinator + 1 ms own fixed, 1 ms per layer, and its output layer.
    per_byte = 0.001 / (10 * MIB)
    output = 0.003
    alone = NodeProfile(fixed_s=0.002, seconds_per_byte=per_byte, measured_at=0, samples=1, output_s=output)
    # Together (one layer each): coordinator once, both fixed costs, both layers, one output.
    pair = 0.001 + 0.002 + 0.002 + output
    assert fit_overhead(model, alone, alone, pair, 1) == pytest.approx(0.001)
    speed = node_speed(model, alone, 0.001)
    assert speed.fixed_s == pytest.approx(0.001)
    assert speed.output_s == pytest.approx(output)
    assert speed.per_layer_s == pytest.approx(0.001)


def test_depths_fit_the_node() -> None:
    model = facts()
    # One 10 MiB layer + the 2 MiB output, and two layers + output, loaded at the same time (with their
    # compute buffers, here of 8 tokens).
    assert depths_for(model, 40 * MIB) == (1, 2)
    assert depths_for(model, 30 * MIB) == (1, 1)  # one depth: no slope, charged to the layers
    assert depths_for(model, 12 * MIB) is None  # one layer and the output do not fit


def test_a_deep_second_layout_when_the_output_layer_outweighs_the_layers() -> None:
    # 1 MiB layers under a 40 MiB output layer (a small model with a large vocabulary): two layers more would be
    # lost in a token's noise, so the second layout holds enough layers to weigh a quarter of the first one.
    model = facts(n_layers=18, layer=MIB, output=40 * MIB)
    assert depths_for(model, 1 << 30) == (1, 12)
    assert depths_for(facts(), 1 << 30) == (1, 3)  # layers that weigh enough: the usual two more


def test_a_node_that_cannot_hold_a_layer_is_never_chosen() -> None:
    model = facts()
    fast = fit_node(model, (0.003, 0.005), (0.002, 0.004), (1, 3), 1)
    speeds = [node_speed(model, None, 0.0), node_speed(model, fast, 0.0)]
    assert math.isinf(speeds[0].fixed_s)
    plan = plan_compute(model, [NodeCapacity("tiny", 1 << 30), NodeCapacity("big", 1 << 30)], speeds, 64)
    assert plan.layers[0] is None


def test_cache_round_trip_and_keys(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path)
    profile = NodeProfile(fixed_s=0.001, seconds_per_byte=1e-10, measured_at=1.0, samples=40)
    key = profile_key(["gpu", "ssh", "10.0.0.2", 22], "model-a")
    assert cache.load(key) is None
    cache.save(key, profile)
    assert cache.load(key) == profile
    assert profile_key(["gpu", "ssh", "10.0.0.2", 22], "model-b") != key  # another model, another profile
    (tmp_path / f"{key}.json").write_text("{broken")
    assert cache.load(key) is None  # a damaged entry is measured again, not an error
    cache.save_overhead("c", 0.0005)
    assert cache.load_overhead("c") == 0.0005


def test_model_fingerprint_changes_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"one")
    first = model_fingerprint(path)
    path.write_bytes(b"other")
    assert model_fingerprint(path) != first

