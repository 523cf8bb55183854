"""The worker tests' fixtures. Test modules load them with ``pytest_plugins =
["worker_fixtures"]``: a conftest.py in this directory would take the module name ``conftest``
from the suite's own."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import kvalloc.worker.attention.hook as hook
import kvalloc.worker.attention.mla as mla
import kvalloc.worker.attention.rotary as rotary
import kvalloc.worker.mlp.gated_mlp as gated_mlp
import kvalloc.worker.norm.rms_norm as rms_norm
import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.engine import Engine
from kvalloc.worker.fusion import fuse_model
from kvalloc.worker.step.decode_graphs import DecodeGraphs
from worker_oracle import CONFIGS, Oracle, make_oracle


@pytest.fixture(scope="session")
def one_thread() -> Iterator[None]:
    """Tiny matrices: torch's thread pool only adds contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def oracle(request: pytest.FixtureRequest, one_thread: None) -> Oracle:
    return make_oracle(request.param)


@pytest.fixture(scope="session")
def llama_oracle(one_thread: None) -> Oracle:
    return make_oracle("llama")


@pytest.fixture
def connect() -> Iterator[Callable[[ServiceConfig], Client]]:
    """A registered, attached in-process client on a fresh core per call (``overlap``: one
    that runs a step ahead and commits its own tokens)."""
    cores: list[ServiceCore] = []

    def factory(config: ServiceConfig, *, overlap: bool = False) -> Client:
        cores.append(ServiceCore(config))
        client = Client.in_process(cores[-1], worker_id="worker")
        client.register(overlap=overlap)
        return client

    yield factory
    for core in cores:
        core.close()


@pytest.fixture
def rerun_graphs(monkeypatch: pytest.MonkeyPatch) -> Callable[[Engine], DecodeGraphs]:
    """Decode graphs on a CPU, installed on an engine that pads its decodes: each replay runs
    the captured body again with the capture's plan and its static inputs (reloaded with the
    step's), and the pool attention runs its kernel (Triton's interpreter), the one a GPU
    captures (the latent attention's too). What a replay computes, where a CPU test can check
    it."""
    monkeypatch.setattr(hook, "kernel_takes", lambda query, pool_k, layout: True)
    monkeypatch.setattr(mla, "kernel_takes", lambda q_latent, pool: True)

    def install(engine: Engine) -> DecodeGraphs:
        engine.step.graphs = DecodeGraphs(capture=lambda body: body)
        return engine.step.graphs

    return install


@pytest.fixture
def fused_on_cpu(rerun_graphs: Callable, monkeypatch: pytest.MonkeyPatch
                 ) -> Callable[[torch.nn.Module], torch.nn.Module]:
    """A copy of a model switched to the worker's fused forwards, whose kernels all run on a
    CPU (Triton's interpreter): the forward a CUDA worker runs, norms, merged projections,
    rotary and staging, SiLU-and-multiply and the pool attention alike."""
    for module in (rms_norm, rotary, gated_mlp):
        monkeypatch.setattr(module, "kernel_takes", lambda *args: True)
    monkeypatch.setattr(rotary, "attention_kernel_takes", lambda *args: True)

    def fused(model: torch.nn.Module) -> torch.nn.Module:
        twin = copy.deepcopy(model)
        fuse_model(twin)
        return twin

    return fused
