"""/v1/state's ``device`` is read without initializing CUDA: a rank that has not (a gloo rank on
a GPU host) reports a CPU, and its GPU is looked up once the rank itself has initialized CUDA."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from worker_server.state import RankIdentity, RankState, library_versions


class FakeCuda:
    """torch.cuda on a host with two GPUs (a stand-in: no GPU here): asking a device's
    properties initializes CUDA, as torch's ``_lazy_init`` does."""

    def __init__(self) -> None:
        self.initialized = False
        self.inits = 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def is_initialized(self) -> bool:
        return self.initialized

    def _lazy_init(self) -> None:
        self.inits += 0 if self.initialized else 1
        self.initialized = True

    def get_device_properties(self, index: int):
        self._lazy_init()
        return SimpleNamespace(uuid=f"GPU-{index}")


def test_a_snapshot_never_initializes_cuda_and_reports_the_gpu_once_the_rank_has(monkeypatch):
    """The first /v1/state or /metrics read initialized CUDA from an HTTP thread: the rank's
    next step timed on CUDA events, a context on GPU 0 in every CPU rank."""
    library_versions()  # read once per process: before the stand-in
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    state = RankState(RankIdentity(local_rank=3))
    for _ in range(2):
        assert state.snapshot()["device"] == {"type": "cpu"}
    assert (cuda.initialized, cuda.inits) == (False, 0)
    cuda.initialized = True  # the training thread moved its model to the GPU
    assert state.snapshot()["device"] == {"type": "cuda", "index": 1, "uuid": "GPU-1"}
    assert cuda.inits == 0


def test_set_device_before_cuda_is_initialized_is_reported_once_it_is(monkeypatch):
    library_versions()
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    state = RankState(RankIdentity(local_rank=1))
    state.set_device(0)
    assert state.snapshot()["device"] == {"type": "cpu"} and cuda.inits == 0
    cuda.initialized = True
    assert state.snapshot()["device"] == {"type": "cuda", "index": 0, "uuid": "GPU-0"}
    assert state.snapshot()["device"]["index"] == 0  # the lookup does not undo set_device
