"""Synthetic Flight Recorder dumps for tests and benchmarks.

A :class:`FRJob` simulates a job collective by collective and renders, per rank, the dump torch
would have produced: NCCL flavour (``state`` completed, ``duration_ms`` and discovery timestamps
filled in) or gloo flavour (``state`` stays ``scheduled``, timestamps 0, ``pg_config`` holding
only the default group as ``''``). Each rank has its own clock (ranks on one host share an
offset), its own ``record_id`` counter across all its groups, and a ring buffer that keeps only
its newest ``buffer_size`` entries, so ranks with different workloads wrap at different points.

    job = FRJob(world_size=4, flavour="nccl")
    job.group("1", [0, 1], desc="tp_0")
    job.repeat(10, [("0", "all_reduce", [[1024]]), ("1", "all_gather", [[256]])])
    job.collective("0", "all_reduce", [[1024]], sizes={2: [[512]]})  # rank 2 disagrees
    job.collective("0", "all_reduce", [[1024]], absent=[3])          # 3 never arrives
    dumps = job.dumps(buffer_size=100)                                # {rank: dump dict}
    write_dumps(dumps, tmp_path, fmt="pickle")                        # rank0, rank1, ...

torchft process groups (one incarnation per quorum, ``collective_seq_id`` restarting at 1,
``pg_id`` growing per process, group name ``''``) are built with :meth:`FRJob.quorum` and
:meth:`FRJob.ft_collective`; dumps then carry the ``incarnations`` list of docs/CONTRACTS.md.
"""

from __future__ import annotations

import json
import math
import pickle
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FRJob", "write_dumps", "FT_GROUP"]

FT_GROUP = ""  # the torchft group's process-group name on gloo

_MS = 1_000_000
_EPOCH_NS = 1_795_000_000_000_000_000


@dataclass
class _Group:
    name: str
    desc: str
    ranks: list[int]


@dataclass
class _Incarnation:
    pg_id: int
    quorum_id: int
    group_rank: int
    replica_rank: int
    global_ranks: list[int]
    first_record_id: int
    started_ns: int


@dataclass
class _Rank:
    rank: int
    host: str
    clock_offset_ns: int
    now_ns: int = _EPOCH_NS  # true time at which this rank is next free to enqueue
    next_record_id: int = 0
    next_pg_id: int = 0
    entries: list[dict[str, Any]] = field(default_factory=list)
    pg_ids: dict[str, int] = field(default_factory=dict)
    seq: dict[Any, int] = field(default_factory=dict)
    incarnations: list[_Incarnation] = field(default_factory=list)


class FRJob:
    """A simulated job whose ranks record Flight Recorder entries.

    ``flavour`` is ``"nccl"`` or ``"gloo"``; ``hosts`` maps rank -> host name (default: one host
    per 8 ranks); ``skew_ms`` is the spread of per-host clock offsets; ``jitter_ms`` the mean of
    the exponential noise added to every rank's compute time before each collective;
    ``compute_ms`` the base compute time between collectives.
    """

    def __init__(
        self,
        world_size: int,
        *,
        flavour: str = "nccl",
        version: str = "2.10",
        hosts: Mapping[int, str] | None = None,
        skew_ms: float = 5.0,
        jitter_ms: float = 0.5,
        compute_ms: float = 20.0,
        frames: int = 1,
        seed: int = 0,
        replica_group_size: int | None = None,
    ) -> None:
        if flavour not in ("nccl", "gloo"):
            raise ValueError(f"unknown flavour {flavour!r}")
        self.world_size = world_size
        self.flavour = flavour
        self.version = version
        self.jitter_ms = jitter_ms
        self.compute_ms = compute_ms
        self.frames = frames
        self.replica_group_size = replica_group_size
        self._rng = random.Random(seed)
        hosts = dict(hosts) if hosts is not None else {r: f"host{r // 8}" for r in range(world_size)}
        host_offsets = {h: int(self._rng.uniform(-skew_ms, skew_ms) * _MS) for h in sorted(set(hosts.values()))}
        self._ranks = {r: _Rank(r, hosts[r], host_offsets[hosts[r]]) for r in range(world_size)}
        self._groups: dict[str, _Group] = {}
        self.group("0", list(range(world_size)), desc="default_pg")
        self._quorum_id: int | None = None
        self._ft_members: dict[int, list[int]] = {}  # group_rank -> global ranks of current quorum

    # ---- topology -------------------------------------------------------------------------
    def group(self, name: str, ranks: Sequence[int], *, desc: str | None = None) -> None:
        """Create process group ``name`` over global ``ranks`` (every member gets a pg_id)."""
        self._groups[name] = _Group(name, desc or ("undefined" if self.flavour == "gloo" else f"group_{name}"), list(ranks))
        for r in ranks:
            state = self._ranks[r]
            state.pg_ids[name] = int(name) if (self.flavour == "nccl" and name.isdigit()) else state.next_pg_id
            state.next_pg_id += 1

    def quorum(self, quorum_id: int, replica_groups: Sequence[int]) -> None:
        """Start a torchft incarnation: a fresh ``''`` group per group rank over ``replica_groups``.

        Needs ``replica_group_size``; global rank = replica_group * replica_group_size + group_rank.
        """
        size = self.replica_group_size
        if size is None:
            raise ValueError("quorum() needs FRJob(replica_group_size=...)")
        self._quorum_id = quorum_id
        self._ft_members = {}
        for group_rank in range(size):
            members = [rg * size + group_rank for rg in replica_groups]
            self._ft_members[group_rank] = members
            for replica_rank, r in enumerate(members):
                state = self._ranks[r]
                state.incarnations.append(
                    _Incarnation(
                        pg_id=state.next_pg_id,
                        quorum_id=quorum_id,
                        group_rank=group_rank,
                        replica_rank=replica_rank,
                        global_ranks=members,
                        first_record_id=state.next_record_id,
                        started_ns=state.now_ns + state.clock_offset_ns,
                    )
                )
                state.next_pg_id += 1

    # ---- activity -------------------------------------------------------------------------
    def collective(
        self,
        pg: str,
        op: str = "all_reduce",
        sizes: Sequence[Sequence[int]] = ((1024,),),
        *,
        dtype: str = "Float",
        ops: Mapping[int, str] | None = None,
        rank_sizes: Mapping[int, Sequence[Sequence[int]]] | None = None,
        dtypes: Mapping[int, str] | None = None,
        absent: Iterable[int] = (),
        delay_ms: Mapping[int, float] | None = None,
        complete: bool | None = None,
        members: Sequence[int] | None = None,
    ) -> None:
        """Every member of ``pg`` enqueues one collective (one sequence id).

        ``ops`` / ``rank_sizes`` / ``dtypes`` override what individual ranks enqueue (a mismatch);
        ``absent`` ranks never enqueue it, which leaves it pending on the others (a hang);
        ``delay_ms`` makes ranks arrive late (a straggler); ``complete=False`` leaves it pending
        on everyone.
        """
        group_members = list(members) if members is not None else self._groups[pg].ranks
        self._enqueue(
            key=pg,
            pg_name=pg,
            desc=self._groups[pg].desc if pg in self._groups else "undefined",
            members=group_members,
            pg_id_of=lambda state: state.pg_ids[pg],
            op=op,
            sizes=sizes,
            dtype=dtype,
            ops=ops or {},
            rank_sizes=rank_sizes or {},
            dtypes=dtypes or {},
            absent=set(absent),
            delay_ms=delay_ms or {},
            complete=complete,
        )

    def ft_collective(
        self,
        op: str = "all_reduce",
        sizes: Sequence[Sequence[int]] = ((1024,),),
        *,
        group_ranks: Iterable[int] | None = None,
        dtype: str = "Float",
        ops: Mapping[int, str] | None = None,
        rank_sizes: Mapping[int, Sequence[Sequence[int]]] | None = None,
        dtypes: Mapping[int, str] | None = None,
        absent: Iterable[int] = (),
        delay_ms: Mapping[int, float] | None = None,
        complete: bool | None = None,
    ) -> None:
        """One collective on the current torchft incarnation, for each group rank's group.

        Keyword arguments are those of :meth:`collective`, with global ranks.
        """
        if self._quorum_id is None:
            raise ValueError("call quorum() first")
        chosen = sorted(self._ft_members) if group_ranks is None else list(group_ranks)
        for group_rank in chosen:
            members = self._ft_members[group_rank]
            quorum_id = self._quorum_id

            def pg_id_of(state: _Rank, quorum_id: int = quorum_id) -> int:
                return next(i.pg_id for i in reversed(state.incarnations) if i.quorum_id == quorum_id)

            self._enqueue(
                key=("ft", quorum_id, group_rank),
                pg_name=FT_GROUP,
                desc="undefined",
                members=members,
                pg_id_of=pg_id_of,
                op=op,
                sizes=sizes,
                dtype=dtype,
                ops=ops or {},
                rank_sizes=rank_sizes or {},
                dtypes=dtypes or {},
                absent=set(absent),
                delay_ms=delay_ms or {},
                complete=complete,
            )

    def repeat(self, times: int, pattern: Sequence[tuple[str, str, Sequence[Sequence[int]]]], **kwargs: Any) -> None:
        """Run ``pattern`` (a list of ``(pg, op, sizes)``) ``times`` times, e.g. training steps."""
        for _ in range(times):
            for pg, op, sizes in pattern:
                self.collective(pg, op, sizes, **kwargs)

    def _enqueue(
        self,
        *,
        key: Any,
        pg_name: str,
        desc: str,
        members: list[int],
        pg_id_of: Any,
        op: str,
        sizes: Sequence[Sequence[int]],
        dtype: str,
        ops: Mapping[int, str],
        rank_sizes: Mapping[int, Sequence[Sequence[int]]],
        dtypes: Mapping[int, str],
        absent: set[int],
        delay_ms: Mapping[int, float],
        complete: bool | None,
    ) -> None:
        present = [r for r in members if r not in absent]
        arrival: dict[int, int] = {}
        for r in present:
            state = self._ranks[r]
            compute = self.compute_ms + self._rng.expovariate(1.0 / self.jitter_ms) if self.jitter_ms > 0 else self.compute_ms
            arrival[r] = state.now_ns + int((compute + delay_ms.get(r, 0.0)) * _MS)
        finished = (not absent) if complete is None else (complete and not absent)
        nbytes = math.prod(sizes[0]) * 4 if sizes and sizes[0] else 0
        transfer_ns = int((0.05 + nbytes / 10e9 * 1e3) * _MS)
        done_ns = max(arrival.values(), default=0) + transfer_ns
        for r in present:
            state = self._ranks[r]
            seq = state.seq.get(key, 0) + 1
            state.seq[key] = seq
            r_op = ops.get(r, op)
            in_sizes = [list(s) for s in rank_sizes.get(r, sizes)]
            out_sizes = _output_sizes(r_op, in_sizes, len(members))
            r_dtype = dtypes.get(r, dtype)
            created = arrival[r] + state.clock_offset_ns
            entry: dict[str, Any] = {
                "record_id": state.next_record_id,
                "pg_id": pg_id_of(state),
                "process_group": [pg_name, desc],
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": f"{self.flavour}:{r_op}",
                "time_created_ns": created,
                "input_sizes": in_sizes,
                "input_dtypes": [r_dtype] * len(in_sizes),
                "output_sizes": out_sizes,
                "output_dtypes": [r_dtype] * len(out_sizes),
                "state": "scheduled",
                "time_discovered_started_ns": 0,
                "time_discovered_completed_ns": 0,
                "retired": finished,
                "timeout_ms": 600000,
                "is_p2p": False,
                "thread_name": "pt_main_thread",
                "thread_id": "140000000000001",
            }
            if self.flavour == "nccl":
                entry["time_discovered_started_ns"] = created + 50_000
                if finished:
                    entry["state"] = "completed"
                    entry["time_discovered_completed_ns"] = done_ns + state.clock_offset_ns
                    entry["duration_ms"] = round((done_ns - arrival[r]) / _MS, 3)
                else:
                    entry["state"] = "started"
                    entry["duration_ms"] = None
            state.entries.append(entry)
            state.next_record_id += 1
            if finished:
                state.now_ns = done_ns
            else:
                state.now_ns = arrival[r]

    # ---- output ---------------------------------------------------------------------------
    def dumps(
        self,
        *,
        buffer_size: int | Mapping[int, int] | None = None,
        ranks: Iterable[int] | None = None,
        fmt: str = "json",
    ) -> dict[int, dict[str, Any]]:
        """Per-rank dumps after the ring buffer kept each rank's newest ``buffer_size`` entries.

        ``fmt="json"`` gives what ``_dump_*_json`` returns (``pg_status`` values as strings, no
        ``frames``); ``fmt="pickle"`` what ``_dump_nccl_trace``/``_dump_fr_trace`` return.
        """
        chosen = range(self.world_size) if ranks is None else ranks
        return {r: self._dump(r, buffer_size, fmt) for r in chosen}

    def _dump(self, rank: int, buffer_size: int | Mapping[int, int] | None, fmt: str) -> dict[str, Any]:
        state = self._ranks[rank]
        keep = buffer_size.get(rank) if isinstance(buffer_size, Mapping) else buffer_size
        entries = state.entries if keep is None else state.entries[-keep:] if keep else []
        out_entries = []
        frames = [{"name": "train_step", "filename": "train.py", "line": 80 + i} for i in range(self.frames)]
        for e in entries:
            e = dict(e)
            if fmt == "pickle":
                e["frames"] = frames
            out_entries.append(e)
        if self.flavour == "gloo":
            pg_config = {"": {"name": "", "desc": "", "ranks": "[]"}}
        else:
            pg_config = {
                g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.ranks)}
                for g in self._groups.values()
                if rank in g.ranks
            }
        pg_status = {}
        for key, seq in state.seq.items():
            pg_id = state.pg_ids[key] if isinstance(key, str) else next(
                i.pg_id for i in reversed(state.incarnations) if i.quorum_id == key[1]
            )
            done = [e["collective_seq_id"] for e in state.entries if e["pg_id"] == pg_id and e["retired"]]
            status = {
                "last_enqueued_collective": seq,
                "last_started_collective": seq if self.flavour == "nccl" else -1,
                "last_completed_collective": max(done, default=-1),
            }
            pg_status[str(pg_id)] = {k: str(v) for k, v in status.items()} if fmt == "json" else status
        dump: dict[str, Any] = {
            "version": self.version,
            "comm_lib_version": "2.27.5" if self.flavour == "nccl" else "",
            "pg_config": pg_config,
            "pg_status": pg_status,
            "entries": out_entries,
            "nccl_comm_state": {},
        }
        if state.incarnations:
            size = self.replica_group_size or 1
            dump.update(
                rank=rank,
                replica_group=rank // size,
                group_rank=rank % size,
                group_world_size=size,
                host=state.host,
                incarnations=[
                    {
                        "pg_id": i.pg_id,
                        "pg_name": FT_GROUP,
                        "quorum_id": i.quorum_id,
                        "group_rank": i.group_rank,
                        "replica_rank": i.replica_rank,
                        "replica_world_size": len(i.global_ranks),
                        "global_ranks": i.global_ranks,
                        "first_record_id": i.first_record_id,
                        "started_ns": i.started_ns,
                    }
                    for i in state.incarnations
                ],
            )
        return dump

    def host_of(self, rank: int) -> str:
        return self._ranks[rank].host


def _output_sizes(op: str, sizes: list[list[int]], group_size: int) -> list[list[int]]:
    if op in ("all_gather", "_all_gather_base", "all_gather_into_tensor_coalesced") and sizes:
        return [[sizes[0][0] * group_size, *sizes[0][1:]]] if sizes[0] else [[]]
    if op in ("reduce_scatter", "_reduce_scatter_base") and sizes and sizes[0]:
        return [[max(1, sizes[0][0] // group_size), *sizes[0][1:]]]
    return [list(s) for s in sizes]


def write_dumps(
    dumps: Mapping[int, Mapping[str, Any]],
    directory: str | Path,
    *,
    fmt: str = "pickle",
    prefix: str = "rank",
) -> list[Path]:
    """Write one file per rank: ``<prefix><rank>`` (pickle) or ``<prefix><rank>.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, dump in dumps.items():
        if fmt == "pickle":
            path = directory / f"{prefix}{rank}"
            path.write_bytes(pickle.dumps(dict(dump), protocol=pickle.HIGHEST_PROTOCOL))
        elif fmt == "json":
            path = directory / f"{prefix}{rank}.json"
            path.write_text(json.dumps(dump))
        else:
            raise ValueError(f"unknown format {fmt!r}")
        paths.append(path)
    return paths


def steady_dump(
    rank: int,
    world_size: int,
    entries: int,
    *,
    tp: int = 8,
    flavour: str = "nccl",
    frames: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """One rank's dump of a healthy job, built without simulating the other ranks.

    The job has a default group, tensor-parallel groups of ``tp`` consecutive ranks and
    data-parallel groups of the ranks with the same tensor-parallel index; each step runs an
    all_gather on TP, a reduce_scatter on DP and an all_reduce on the default group. Timings come
    from a generator seeded by the step, so every rank's dump agrees with every other's. Cheap
    enough to write 1024 ranks x 2000 entries one rank at a time (for benchmarks).
    """
    tp = max(1, min(tp, world_size))
    tp_index, tp_group = rank % tp, rank // tp
    n_tp = world_size // tp
    groups = [
        ("0", "default_pg", list(range(world_size)), "all_reduce", [[4096]], [[4096]]),
        (str(1 + tp_group), f"tp_{tp_group}", list(range(tp_group * tp, tp_group * tp + tp)), "all_gather", [[512]], [[512 * tp]]),
        (str(1 + n_tp + tp_index), f"dp_{tp_index}", list(range(tp_index, world_size, tp)), "reduce_scatter", [[256 * n_tp]], [[256]]),
    ]
    stack = [{"name": f"fn{i}", "filename": "model.py", "line": 10 + i} for i in range(frames)]
    offset = (rank // 8) * 1_700_000  # host clock offset, ns
    out = []
    # ring buffer: keep the newest `entries` of 3 per step, whole steps back from a fixed end
    total_steps = entries // 3 + 5
    first = total_steps * 3 - entries
    for record_id in range(first, total_steps * 3):
        step, which = divmod(record_id, 3)
        name, desc, _members, op, in_sizes, out_sizes = groups[which]
        rng = random.Random(seed * 1_000_003 + record_id)
        t = _EPOCH_NS + record_id * 7 * _MS
        jitter = int(rng.random() * 0.3 * _MS) + (rank * 7919 + record_id) % 50_000
        created = t + jitter + offset
        entry = {
            "record_id": record_id,
            "pg_id": int(name),
            "process_group": [name, desc],
            "collective_seq_id": step + 1,
            "p2p_seq_id": 0,
            "op_id": step + 1,
            "profiling_name": f"{flavour}:{op}",
            "time_created_ns": created,
            "input_sizes": in_sizes,
            "input_dtypes": ["Float"],
            "output_sizes": out_sizes,
            "output_dtypes": ["Float"],
            "state": "completed" if flavour == "nccl" else "scheduled",
            "time_discovered_started_ns": created + 40_000 if flavour == "nccl" else 0,
            "time_discovered_completed_ns": t + int(1.2 * _MS) + offset if flavour == "nccl" else 0,
            "retired": True,
            "timeout_ms": 600000,
            "is_p2p": False,
            "thread_name": "pt_main_thread",
            "thread_id": "140000000000001",
            "frames": stack,
        }
        if flavour == "nccl":
            entry["duration_ms"] = round((int(1.2 * _MS) - jitter) / _MS, 4)
        out.append(entry)
    pg_config = {
        name: {"name": name, "desc": desc, "ranks": str(members)} for name, desc, members, *_ in groups
    }
    last_seq = total_steps
    pg_status = {
        name: {"last_enqueued_collective": last_seq, "last_started_collective": last_seq, "last_completed_collective": last_seq}
        for name, *_ in groups
    }
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5",
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": out,
        "nccl_comm_state": {},
    }


def plain_dump(
    rank: int,
    world_size: int,
    entries: int,
    *,
    flavour: str = "nccl",
    frames: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """One rank's dump of a healthy job with a single process group (the "plain" shape).

    Every entry is an all_reduce on the default group ``"0"`` with ``frames`` stack frames, as a
    plain data-parallel job records it. Unlike :func:`steady_dump`, every entry gets its own
    lists and dicts (sizes, dtypes, frames), as torch's C++ pickler writes them (it shares
    repeated strings, never containers), so loading costs what a real dump of this shape costs.
    Timings come from a generator seeded by ``seed`` and the record id, so every rank agrees.
    """
    offset = (rank // 8) * 1_700_000  # host clock offset, ns
    total = entries + 5  # the ring buffer has wrapped: record ids start above 0
    status = "completed" if flavour == "nccl" else "scheduled"
    profiling_name = f"{flavour}:all_reduce"
    out = []
    for record_id in range(total - entries, total):
        rng = random.Random(seed * 1_000_003 + record_id)
        t = _EPOCH_NS + record_id * 7 * _MS
        jitter = int(rng.random() * 0.3 * _MS) + (rank * 7919 + record_id) % 50_000
        created = t + jitter + offset
        entry = {
            "record_id": record_id,
            "pg_id": 0,
            "process_group": ["0", "default_pg"],
            "collective_seq_id": record_id + 1,
            "p2p_seq_id": 0,
            "op_id": record_id + 1,
            "profiling_name": profiling_name,
            "time_created_ns": created,
            "input_sizes": [[4096]],
            "input_dtypes": ["Float"],
            "output_sizes": [[4096]],
            "output_dtypes": ["Float"],
            "state": status,
            "time_discovered_started_ns": created + 40_000 if flavour == "nccl" else 0,
            "time_discovered_completed_ns": t + int(1.2 * _MS) + offset if flavour == "nccl" else 0,
            "retired": True,
            "timeout_ms": 600000,
            "is_p2p": False,
            "thread_name": "pt_main_thread",
            "thread_id": "140000000000001",
            "frames": [{"name": f"fn{i}", "filename": "train.py", "line": 80 + i} for i in range(frames)],
        }
        if flavour == "nccl":
            entry["duration_ms"] = round((int(1.2 * _MS) - jitter) / _MS, 4)
        out.append(entry)
    last_seq = total
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5" if flavour == "nccl" else "",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world_size)))}},
        "pg_status": {
            "0": {"last_enqueued_collective": last_seq, "last_started_collective": last_seq, "last_completed_collective": last_seq}
        },
        "entries": out,
        "nccl_comm_state": {},
    }


TP_STEP = [("0", "all_reduce", [[1024]]), ("1", "all_gather", [[64]]), ("2", "all_gather", [[64]])]
"""One training step of :func:`tp_job`: a default-group all_reduce, an all_gather per tp group."""


def tp_job(flavour: str = "nccl", **kwargs) -> FRJob:
    """4 ranks: default group, tp groups "1" = {0, 1} and "2" = {2, 3}."""
    job = FRJob(4, flavour=flavour, **kwargs)
    job.group("1", [0, 1])
    job.group("2", [2, 3])
    return job


def loaded_pair_job(seed: int, *, bias_ms: float, steps: int = 200) -> FRJob:
    """Two replica groups of one rank on one host under heavy load, torchft's group between them:
    each step every rank computes ~40 ms plus exponential jitter (mean 6 ms), one step in ten of
    each rank stalls a further ~30 ms on average (the scheduler gave its core away), and rank 1
    is ``bias_ms`` slower on average (its core is the busier one). A model of what a CI run at
    load ~25 gave ``lightkeeper analyze`` (its dumps were not kept)."""
    job = FRJob(2, flavour="gloo", hosts={0: "h0", 1: "h0"}, replica_group_size=1,
                jitter_ms=6.0, compute_ms=40.0, seed=seed)
    rng = random.Random(seed + 100)
    job.quorum(1, [0, 1])
    for _ in range(steps):
        delay = {1: bias_ms}
        for r in (0, 1):
            if rng.random() < 0.1:
                delay[r] = delay.get(r, 0.0) + rng.expovariate(1 / 30.0)
        job.ft_collective("all_reduce", [[4096]], delay_ms=delay)
    return job


THREE_GROUP_STEP = [("0", "all_reduce", [[4096]]), ("1", "all_gather", [[512]]), ("2", "reduce_scatter", [[2048]])]
"""One training step of :func:`three_group_job`: one collective on each of three 8-rank groups."""


def three_group_job(seed: int, *, late_ms: float = 6.0, late_rank: int = 5, steps: int = 120,
                    flavour: str = "nccl", shared: bool = False, everywhere_ms: float = 0.0
                    ) -> FRJob:
    """8 ranks on one host, three process groups over all of them (default, "1", "2"), one
    collective on each per step after ~19 ms of compute plus 0-4 ms of uniform jitter per rank (a
    step ~72 ms); ``late_rank`` arrives ``late_ms`` later into group "1"'s collective only.
    ``shared``: the three collectives all on the default group; ``everywhere_ms``: ``late_rank``
    that much later into every collective besides."""
    job = FRJob(8, flavour=flavour, hosts={r: "h0" for r in range(8)}, jitter_ms=0.0,
                compute_ms=19.0, seed=seed)
    if not shared:
        job.group("1", list(range(8)))
        job.group("2", list(range(8)))
    rng = random.Random(seed + 100)
    for _ in range(steps):
        for pg, op, sizes in THREE_GROUP_STEP:
            delay = {r: rng.uniform(0.0, 4.0) for r in range(8)}
            delay[late_rank] += everywhere_ms
            if pg == "1":
                delay[late_rank] += late_ms
            job.collective("0" if shared else pg, op, sizes, delay_ms=delay)
    return job
