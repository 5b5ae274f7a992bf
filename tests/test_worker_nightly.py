"""The WorkerServer on both torchft shapes and on a Manager it does not know, without nightly.

torchft 0.2 rebuilds its process group with ``pg.configure(store_addr, replica_id, rank,
world_size, quorum_id, ...)``; torchft-nightly with ``pg.reconfigure(opts)`` (torch's reconfigure
API: ``opts.uuid`` is the communicator id, which the Manager sets to the quorum id, ``opts.handles``
the members' JSON handles in rank order) or, for a plain torch group made with
``enable_reconfigure=True`` (which takes no Python attributes), through the Manager's
``_reconfigure_pg(communicator_id, handles)``. This process imports torchft 0.2.0, so the
nightly shapes here are fake objects written after nightly's torchft/process_group.py and
manager.py; a real job on torchft-nightly is tests/test_torchft_versions_e2e.py's.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from rank_wire import recorders
from rank_wire.recorders import is_torchft_pg_name
from worker_server import RankIdentity, RankState, WorkerServer, autostart
from worker_server import flight_recorder as fr
from worker_server.flight_recorder import IncarnationTracker
from worker_server.state import module_version


def handle(handle_id: str, global_rank: int | None) -> str:
    """A nightly torchft handle (ProcessGroup.get_reconfigure_handle)."""
    return json.dumps({"id": handle_id, "store": "h:1", "global_rank": global_rank})


class NightlyPG:
    """torchft-nightly's ProcessGroupWrapper as far as the tracker sees it."""

    def __init__(self, handle_id: str) -> None:
        self.id, self.calls = handle_id, []

    def _handle_id(self) -> str:
        return self.id

    def reconfigure(self, opts):
        self.calls.append(opts.uuid)
        return "work"


class NativePG:
    """A torch process group made with enable_reconfigure=True: no Python attributes."""

    __slots__ = ("_rank",)

    def __init__(self) -> None:
        self._rank = 0

    def reconfigure(self, opts):
        self._rank = 2
        return "work"

    def rank(self) -> int:
        return self._rank


def test_nightly_reconfigure_is_recorded_from_its_options(monkeypatch):
    monkeypatch.setattr(fr, "_first_record_id", lambda pg=None: 40)
    pg = NightlyPG("b")
    tracker = IncarnationTracker(group_rank=1)
    assert tracker.hook(SimpleNamespace(_pg=pg)) == "reconfigure"
    tracker.hook(SimpleNamespace(_pg=pg))  # idempotent: one wrapper
    opts = SimpleNamespace(uuid=7, handles=[handle("a", 1), handle("b", 3), handle("c", 5)])
    assert pg.reconfigure(opts) == "work" and pg.calls == [7]
    inc = tracker.current()
    assert (inc["quorum_id"], inc["replica_rank"], inc["replica_world_size"]) == (7, 1, 3)
    assert inc["global_ranks"] == [1, 3, 5] and inc["first_record_id"] == 40
    assert inc["group_rank"] == 1


def test_a_native_group_is_recorded_through_the_managers_reconfigure_pg(monkeypatch):
    monkeypatch.setattr(fr, "_first_record_id", lambda pg=None: 0)
    pg = NativePG()

    class Manager:  # nightly's Manager._reconfigure_pg, as far as the tracker sees it
        _pg = pg

        def _reconfigure_pg(self, communicator_id, handles):
            self._pg.reconfigure(SimpleNamespace(uuid=communicator_id, handles=handles))

    manager = Manager()
    tracker = IncarnationTracker(group_rank=0)
    assert tracker.hook(manager) == "Manager._reconfigure_pg"
    manager._reconfigure_pg(9, handles=["opaque-0", "opaque-1", "opaque-2"])
    inc = tracker.current()
    assert (inc["quorum_id"], inc["replica_rank"], inc["replica_world_size"]) == (9, 2, 3)
    assert inc["global_ranks"] is None


def test_torchft_0_2_configure_called_with_keywords_is_recorded(monkeypatch):
    monkeypatch.setattr(fr, "_first_record_id", lambda pg=None: 0)

    class PG:
        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None):
            return None

    pg = PG()
    tracker = IncarnationTracker(group_rank=0)
    assert tracker.hook(SimpleNamespace(_pg=pg)) == "configure"
    pg.configure("s", "r", rank=0, world_size=2, quorum_id=3, global_ranks=(0, 2))
    inc = tracker.current()
    assert (inc["quorum_id"], inc["replica_rank"], inc["global_ranks"]) == (3, 0, [0, 2])


def test_an_incarnation_that_cannot_be_read_is_one_line_and_the_call_goes_through(
        monkeypatch, capsys):
    monkeypatch.setattr(fr, "_first_record_id", lambda pg=None: 0)
    pg = NightlyPG("a")
    tracker = IncarnationTracker(group_rank=0)
    tracker.hook(SimpleNamespace(_pg=pg))
    for q in (1, 2):
        assert pg.reconfigure(SimpleNamespace(uuid=q)) == "work"  # no handles: unknown shape
    assert pg.calls == [1, 2] and tracker.current() is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[lightkeeper] Flight Recorder incarnation not")


def test_torchft_group_names_of_both_versions():
    for name in ("", "torchft_quorum_4_rank_1", "torchft_4_rank_1"):
        assert is_torchft_pg_name(name), name
    for name in (None, "0", "torchft_quorum_x_rank_1", "torchft_4_rank_1_extra", "default_pg"):
        assert not is_torchft_pg_name(name), name
    tracker = IncarnationTracker(group_rank=1)
    tracker.record(quorum_id=4, replica_rank=0, replica_world_size=2, global_ranks=None,
                   first_record_id=3)
    dump = {"entries": [{"pg_id": 0, "process_group": ["0", "0"], "record_id": 3},
                        {"pg_id": 5, "process_group": ["torchft_4_rank_1", ""], "record_id": 4}]}
    assert tracker.annotate(json.dumps(dump).encode())[0]["pg_id"] == 5


class Manager:
    """A torchft Manager as the wrappers use it."""

    def __init__(self, pg=None) -> None:
        self._pg = pg if pg is not None else NightlyPG("a")
        self._quorum_id, self._step, self.log = 1, 0, []

    def start_quorum(self):
        self.log.append("start_quorum")
        self._quorum_future = Future()  # torchft's, reached at once here
        self._quorum_future.set_result(None)

    def wait_quorum(self):
        self.log.append("wait_quorum")

    def allreduce(self, tensor):
        self.log.append("allreduce")
        return SimpleNamespace(wait=lambda: tensor)

    def should_commit(self):
        self.log.append("should_commit")
        self._step += 1
        return True

    def current_step(self):
        return self._step

    def num_participants(self):
        return 2

    def is_participating(self):
        return True


def train_step(manager) -> bool:
    manager.start_quorum()
    manager.wait_quorum()
    manager.allreduce(1).wait()
    return manager.should_commit()


class WaitingManager(Manager):
    """``num_participants`` waits on the quorum first, as torchft's does."""

    def num_participants(self):
        self.wait_quorum()
        return 2


def test_the_bookkeepings_own_manager_calls_go_straight_to_torchft():
    """The wrappers read the quorum through the Manager after ``wait_quorum`` and
    ``should_commit``; those calls wait on the quorum again. Through the wrappers they recursed
    to Python's limit at every wait (hundreds of timed waits a step, swallowed as a
    RecursionError); on CUDA the error could strike inside a wait's start and leave every later
    wait of the rank uncounted. Now each of the loop's steps waits on the quorum three times: its
    own, and once for each read."""
    manager = WaitingManager()
    state = RankState(RankIdentity())
    WorkerServer(state).attach(manager)
    for _ in range(3):
        assert train_step(manager) is True
    assert manager.log.count("wait_quorum") == 3 * 3, manager.log.count("wait_quorum")
    snap = state.snapshot()
    assert (snap["num_participants"], snap["participating"], snap["commits"]) == (2, True, 3)


def test_a_healing_steps_commit_is_shown_as_healing():
    """torchft loads the peer's state inside a healing step's should_commit: the rank says
    ``healing`` while it runs, ``commit`` in the steps after."""
    seen = []

    class Healing(Manager):
        def should_commit(self):
            seen.append(state.snapshot()["phase"])
            if self._healing:
                self._step, self._healing = 10, False  # the peer's step, as torchft sets it
            return super().should_commit()

    manager = Healing()
    manager._healing = False
    state = RankState(RankIdentity())
    WorkerServer(state).attach(manager)
    assert train_step(manager) is True
    manager._healing = True  # the next quorum made this group heal from a peer
    assert train_step(manager) is True
    assert train_step(manager) is True
    assert seen == ["commit", "healing", "commit"]
    assert state.snapshot()["phase"] == "optimizer"


@pytest.mark.parametrize("broken", ["no _pg", "pg without configure or reconfigure",
                                    "no allreduce", "pg refuses attributes"])
def test_start_with_a_manager_it_does_not_know_serves_the_rest(broken, capsys):
    """``WorkerServer.start(manager)`` (what ``lightkeeper train`` and a user's script call)
    instruments what it can, says the rest in one line and never raises."""
    manager = Manager()
    if broken == "no _pg":
        del manager._pg
    elif broken == "pg without configure or reconfigure":
        manager._pg = object()
    elif broken == "no allreduce":  # the same Manager class without that method
        manager = type("Manager", (), {k: v for k, v in vars(Manager).items()
                                       if k not in ("allreduce", "__dict__")})()
        manager._pg, manager._quorum_id, manager._step, manager.log = NightlyPG("a"), 1, 0, []
    else:
        manager._pg = NativePG()  # reconfigure, no attributes, no Manager._reconfigure_pg
    server = WorkerServer.start(manager, replica_group=1, group_rank=0, group_world_size=1)
    try:
        err = [line for line in capsys.readouterr().err.splitlines() if line]
        assert len(err) == 1 and err[0].startswith("[lightkeeper] WorkerServer: cannot instrument")
        assert "the rest is served, training goes on" in err[0]
        if broken == "no allreduce":
            manager.start_quorum()
            manager.wait_quorum()
            assert manager.should_commit() is True
        else:
            assert train_step(manager) is True
        state = requests.get(server.url + "/v1/state", timeout=5).json()
        assert state["replica_group"] == 1
        assert state["commits"] == 1 and state["phase"] == "optimizer"
    finally:
        server.stop()


def test_attach_to_an_object_without_attributes_never_raises(capsys):
    server = WorkerServer(RankState(RankIdentity()))
    server.attach(object())
    assert "cannot instrument" in capsys.readouterr().err


def test_a_bookkeeping_error_in_a_wrapper_never_reaches_the_loop(capsys):
    manager = Manager()
    server = WorkerServer(RankState(RankIdentity()))
    server.attach(manager)
    assert capsys.readouterr().err == ""

    def broken():
        raise RuntimeError("torchft moved the step")

    manager.current_step = broken
    assert train_step(manager) is True and train_step(manager) is True
    assert manager.log.count("should_commit") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "step bookkeeping failed (RuntimeError: torchft moved the step)" in err[0]


def test_a_manager_without_its_private_quorum_id_still_shows_its_steps(capsys):
    """A torchft that renames the private ``_quorum_id``: the quorum read failed before the step
    was recorded, so the rank showed step 0, no commits and phase ``commit`` forever (a hang)."""
    manager = Manager()
    del manager._quorum_id
    server = WorkerServer.start(manager, replica_group=1, group_rank=0, group_world_size=1)
    try:
        for _ in range(3):
            assert train_step(manager) is True
        state = requests.get(server.url + "/v1/state", timeout=5).json()
        assert (state["step"], state["commits"], state["phase"]) == (3, 3, "optimizer")
        assert state["last_step_seconds"] is not None
        assert state["timing"]["last_step"]["step"] == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "step bookkeeping failed (AttributeError" in err[0]
    finally:
        server.stop()


def test_the_managers_own_errors_still_propagate():
    manager = Manager()

    def fails():
        raise TimeoutError("quorum")

    manager.start_quorum = fails
    WorkerServer(RankState(RankIdentity())).attach(manager)
    with pytest.raises(TimeoutError, match="quorum"):
        manager.start_quorum()


def cuda_build(monkeypatch, dumps: dict) -> None:
    """This process as a CUDA build with a GPU in use, each recorder's call answering
    ``dumps[name]`` (bytes, or an exception raised). A fake: no GPU here (docs/gpu.md has what
    a real CUDA rank's recorders hold)."""
    torch = pytest.importorskip("torch")
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def answer(name, **kw):
        if isinstance(dumps[name], Exception):
            raise dumps[name]
        return dumps[name]

    for name in (fr.NCCL_JSON, fr.GENERIC_JSON):
        monkeypatch.setattr(c10d, name, lambda name=name, **kw: answer(name), raising=False)


def test_a_cuda_rank_serves_both_recorders_as_one(monkeypatch):
    """A GPU rank: gloo's collectives (the generic recorder) and NCCL's, one dump; the generic
    recorder's ids moved past NCCL's, NCCL's record ids up by one (rank_wire.recorders)."""
    gloo = {"version": "2.10", "entries": [{"pg_id": 0, "process_group": ["", ""],
                                            "record_id": 0, "time_created_ns": 2}]}
    nccl = {"version": "2.10", "entries": [{"pg_id": 0, "process_group": ["0", "default_pg"],
                                            "record_id": 5, "time_created_ns": 1}]}
    dumps = {fr.GENERIC_JSON: json.dumps(gloo).encode(), fr.NCCL_JSON: json.dumps(nccl).encode()}
    cuda_build(monkeypatch, dumps)
    served = json.loads(fr.raw_dump_json())
    assert [(e["process_group"][0], e["pg_id"], e["record_id"]) for e in served["entries"]] == \
        [("0", 0, 6), ("", recorders.SHIFT, recorders.SHIFT)]
    dumps[fr.NCCL_JSON] = RuntimeError("NCCL dump failed")  # gloo's still served, moved
    assert [e["record_id"] for e in json.loads(fr.raw_dump_json())["entries"]] == \
        [recorders.SHIFT]
    dumps[fr.GENERIC_JSON] = b"not json"
    with pytest.raises(fr.FlightRecorderUnavailable, match="NCCL dump failed"):
        fr.raw_dump_json()


def test_torchfts_gloo_group_on_a_gpu_rank_is_served_with_its_incarnation(monkeypatch):
    """TorchTitan's default on GPUs: torchft's cross-group group on gloo (the generic recorder,
    real here: a torchft ProcessGroupGloo in this process), FSDP's collectives in NCCL's (the
    recorded bytes of an H100 rank, tests/fixtures/torch-debug-server-h100). The incarnation is
    resolved to torchft's group, and ``?pg=torchft`` serves its entries, not NCCL's."""
    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from worker_server.endpoints import filter_fr_dump

    nccl = (Path(__file__).parent / "fixtures" / "torch-debug-server-h100" / "healthy"
            / "dump_nccl_trace_json").read_bytes()
    generic = c10d._dump_fr_trace_json
    cuda_build(monkeypatch, {})
    monkeypatch.setattr(c10d, fr.NCCL_JSON, lambda **kw: nccl, raising=False)
    monkeypatch.setattr(c10d, fr.GENERIC_JSON, generic)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo()
    tracker = IncarnationTracker(group_rank=0)
    assert tracker.hook(SimpleNamespace(_pg=pg)) == "configure"
    try:
        pg.configure(f"127.0.0.1:{store.port}/lk-gpu-1", "r0", 0, 1, quorum_id=4)
        for _ in range(3):
            pg.allreduce([torch.ones(4)], dist.AllreduceOptions()).wait()
        body = fr.fr_dump(tracker, {"rank": 0})
        doc = json.loads(body)
        [inc] = doc["incarnations"]
        assert inc["quorum_id"] == 4 and inc["pg_id"] >= recorders.SHIFT  # the generic recorder's
        # torch never clears a process's recorder: torchft groups other tests made in this
        # process are there too, before this incarnation's first record
        ft = [e for e in json.loads(filter_fr_dump(body, "torchft", None))["entries"]
              if e["record_id"] >= inc["first_record_id"]]
        assert len(ft) == 3 and {e["pg_id"] for e in ft} == {inc["pg_id"]}
        assert any(e["profiling_name"].startswith("nccl:") for e in doc["entries"])
    finally:
        pg.shutdown()


def test_version_is_the_imported_packages_whatever_its_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "fakeft").mkdir(parents=True)
    (site / "fakeft" / "__init__.py").write_text("")

    def install(dist: str, version: str) -> None:
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text("fakeft/__init__.py,,0\n")

    install("fakeft_nightly", "2026.10.26")
    install("other", "1.0")
    (site / "other-1.0.dist-info" / "RECORD").write_text("other/fakeft/x.py,,0\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "fakeft", raising=False)
    assert module_version("fakeft") == "2026.10.26"
    install("fakeft", "0.2.0")  # both wrote fakeft/: a mixed install says so
    assert module_version("fakeft") == "0.2.0|2026.10.26"
    monkeypatch.setitem(sys.modules, "fakeft", SimpleNamespace(__version__="9.9"))
    assert module_version("fakeft") == "9.9"  # __version__ first
    assert module_version("no_such_package_lk") == "unknown"


def test_a_python_without_torchft_is_told_in_one_line(monkeypatch):
    import importlib.util

    assert autostart.torchft_missing() is None  # the suite's torchft
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    line = autostart.torchft_missing()
    assert line.startswith(f"torchft is not installed in {sys.executable}") and "\n" not in line
    assert "lightkeeper[worker] does not" in line


def test_an_empty_reconfigure_handle_is_explained_once(monkeypatch, capsys):
    """Nightly ranks under a torchft 0.2.x Lighthouse get empty handles: torchft's rendezvous
    fails with a JSONDecodeError at every quorum and nothing says why."""
    monkeypatch.setattr(fr, "_first_record_id", lambda pg=None: 0)

    class Failing(NightlyPG):
        def reconfigure(self, opts):
            [json.loads(h) for h in opts.handles]  # nightly's _rendezvous, as far as it goes
            return "work"

    pg = Failing("b")
    IncarnationTracker(group_rank=0).hook(SimpleNamespace(_pg=pg))
    for _ in range(3):
        with pytest.raises(json.JSONDecodeError):  # torchft's own error still reaches torchft
            pg.reconfigure(SimpleNamespace(uuid=7, handles=["", handle("b", 1)]))
    err = capsys.readouterr().err
    assert err.count("empty reconfigure handle") == 1 and "torchft_lighthouse" in err, err
    with pytest.raises(ValueError):  # another failure is not explained so
        pg.reconfigure(SimpleNamespace(uuid=8, handles=["not json"]))
    assert "empty reconfigure handle" not in capsys.readouterr().err
