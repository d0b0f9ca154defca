"""Profiling that scales with a layer, not with the model: the profile's time against the model's cold load.

For each model (the real Gemma 3 270M Q4_K_M of tests/realmodel.py, 253 MB, and a synthetic f16 llama model of
`--big-layers` layers at n_embd 2048, 90 MB each: ~4 GB at the default 45, written once into the cache), on two
fresh local workers (`-t 1`, tensor cache on, in an empty cache folder):
  - the profile: every node measured exactly as the controller measures it (core.engine.profile.measure, fresh
    profile cache), including writing its cut copies of the model;
  - the cold load: the whole model loaded across both workers by a llama-cpp-python process, as the
    coordinator does, into fresh workers with empty tensor caches.
It prints both and their ratio per model, then the big model's profile time over the small one's: the profile
reads and ships a few layers and the output layer of a model, so it should stay nearly flat as the model grows
while the load grows with it.

    .venv/bin/python bench/profile_scaling.py [--big-layers 45]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.engine.profile import ProfileCache, Target, measure, profile_key
from core.model import read_model, write_demo_model
from core.nodes.build import cache_dir
from core.planner import NodeCapacity
from tests.harness import free_port, listening
from tests.realmodel import real_model

WORKER = cache_dir() / "bin"


def worker_binary() -> Path:
    """The locally built CPU worker (`make setup` and the tests build it)."""
    found = sorted(WORKER.glob("*-cpu/ggml-rpc-server"))
    if not found:
        raise SystemExit("no local worker build: run `make test` (or `ggml-cluster up`) once first")
    return found[-1]


def big_model(layers: int) -> Path:
    """A synthetic f16 llama model of ``layers`` 90 MB layers, written once into the cache."""
    path = cache_dir() / "models" / f"bench-{layers}x2048.gguf"
    if not path.exists():
        print(f"writing {path.name} (once) …", flush=True)
        write_demo_model(path, n_layers=layers, n_embd=2048, n_ff=5632, n_head=16, n_head_kv=4)
    return path


class Workers:
    """Two fresh local workers with empty tensor caches."""

    def __init__(self) -> None:
        self.scratch = tempfile.TemporaryDirectory(prefix="gcps-")
        self.ports = [free_port(), free_port()]
        binary = worker_binary()
        env = {**os.environ, "XDG_CACHE_HOME": self.scratch.name}
        self.processes = [subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1", "-c"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
                          for port in self.ports]
        deadline = time.monotonic() + 30
        while not all(listening(port) for port in self.ports):
            if time.monotonic() > deadline:
                raise SystemExit("the workers did not start listening")
            time.sleep(0.1)

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
        self.scratch.cleanup()


def profile_seconds(model: Path) -> float:
    """Wall time of measuring both fresh workers for ``model``, cut copies included."""
    facts = read_model(model)
    workers = Workers()
    folder = Path(tempfile.mkdtemp(prefix="gcps-cache-"))
    try:
        targets = [Target(f"n{index}", endpoint, profile_key([endpoint], "bench"), NodeCapacity("n", 64 << 30).usable)
                   for index, endpoint in enumerate(workers.endpoints)]
        started = time.monotonic()
        asyncio.run(measure(facts, targets, ProfileCache(folder / "profiles"), "overhead", folder / "profile.log"))
        return time.monotonic() - started
    finally:
        workers.close()
        shutil.rmtree(folder, ignore_errors=True)


LOAD = """
import json, sys, time
from core.engine.coordinator import FLASH_ATTENTION
from core.engine.rpc_client import register_rpc_servers
config = json.loads(sys.argv[1])
register_rpc_servers(tuple(config["endpoints"]))
import llama_cpp
started = time.monotonic()
llm = llama_cpp.Llama(model_path=config["model"], n_gpu_layers=-1, tensor_split=[1, 1], n_ctx=1024, n_threads=1,
                      flash_attn=FLASH_ATTENTION, verbose=False)
print(time.monotonic() - started)
llm.close()
"""


def cold_load_seconds(model: Path) -> float:
    """Seconds llama-cpp-python takes to load ``model`` across two fresh workers, as the coordinator does."""
    workers = Workers()
    try:
        config = json.dumps({"model": str(model), "endpoints": workers.endpoints})
        done = subprocess.run([sys.executable, "-c", LOAD, config], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1])
        return float(done.stdout.strip().splitlines()[-1])
    finally:
        workers.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big-layers", type=int, default=45, help="layers of the synthetic model (90 MB each)")
    args = parser.parse_args()
    models = {"real": real_model(), "big": big_model(args.big_layers)}
    profiles = {}
    for label, model in models.items():
        profiles[label] = profile_seconds(model)
        load = cold_load_seconds(model)
        size = model.stat().st_size / 1e9
        print(f"{label:<5} {model.name:<28} {size:5.2f} GB  profile {profiles[label]:6.1f} s  cold load {load:6.1f} s"
              f"  profile/load {profiles[label] / load:5.2f}", flush=True)
    print(f"profile time, big over real: {profiles['big'] / profiles['real']:.2f} (goal <= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
