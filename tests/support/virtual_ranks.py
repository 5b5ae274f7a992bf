"""Many virtual ranks behind one server process, for benchmarks at 100,000 ranks.

One asyncio HTTP/1.1 server (keep-alive; an :class:`asyncio.Protocol`, no stream reader or
coroutine per request) answers ``GET /r/<rank>/v1/state`` for ranks
``offset .. offset + n - 1`` with the same ``/v1/state`` document a WorkerServer serves (the
monitor addresses each rank as ``http://127.0.0.1:<port>/r/<rank>``: the same API under a path
prefix, as behind a proxy). A machine with a 20,000 file descriptor limit cannot give 100,000
ranks a port each; the monitor's side (its poller, view, schedule, detectors) is the same.

Ranks are in replica groups of ``group_size`` (group ``rank // group_size``, group rank
``rank % group_size``) and step every ``step_s`` on the server's clock. Each document has a
WorkerServer's keys and sizes: the per-step timings of the last 16 steps (``timing.recent``, as
a WorkerServer's step timer serves them: compute, in-group and cross-group waits, which the
straggler detector reads), the last 64 step times (``recent_step_seconds``), each a float of
full precision as a rank's clock gives it, not a short decimal (a leader's answer ~2.3 KB, as a
WorkerServer's; ``?since=N`` and ``?recent=N`` cut them, and ``?packed=1`` serves them packed,
as worker_server/app.py does). Commands on stdin, one per line: ``hang <rank>``
(the rank stops stepping; its group's rank 0 then waits in an in-group collective, and every
other group's ranks in the cross-group one, as in a real FSDP job), ``slow <group> <seconds>``
(from the next step on the group computes that much longer and every other group waits for it
at the cross-group step; prints ``SLOW <step> <monotonic start of that step>``), ``heal`` (all step again, nobody slow).

``GET /r/<rank>/v1/fr_trace`` (with the WorkerServer's ``?pg=`` / ``?last=`` filter) serves a
small gloo Flight Recorder dump of the rank's in-group process group (tests/support/frgen.py:
six FSDP-like steps; no torchft cross-group entries, so ``pg=torchft`` is empty): in a group
with a hung rank, its peers' newest all-gather is one the hung rank never entered, which the
analysis engine names as an in-group hang, as on a real job. The dumps are rendered once per
(group rank, hung group rank, filter) and stamped with each rank's identity. Prints
``VRANKS <port>`` once listening, serves until stdin closes.

Answers are cheap, so that the ~21,000 requests a second of a 100,000-rank monitor fit beside
it on a small machine: each rank's ``/v1/state`` is cut once into literal pieces around the
values that change (step, phase, timings, wait), and the timing rows are rendered once per
(step, rank % 10, slow group) and shared by every rank with the same rows.

    python -m tests.support.virtual_ranks --ranks 12500 --offset 0 --group-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from urllib.parse import parse_qs

from monitor.poll.poller import EVENT_LOOPS, new_event_loop
from tests.support.frgen import FRJob
from tests.support.monitor_sim import rank_state
from worker_server.endpoints import BOOL_WORDS, MAX_RECENT, filter_fr_dump
from worker_server.packed import PACKED_FORMAT, pack_step_seconds, pack_timing_rows
from worker_server.state import RECENT_STEPS
from worker_server.timing import TIMING_WINDOW

STEP_MARK = 987654321  # placeholders serialized once, cut out of each rank's template
RECENT_MARK, LAST_MARK, PHASE_MARK, WAIT_MARK = "@RECENT@", "@LAST@", "@PHASE@", "@WAIT@"
SECONDS_MARK = "@SECONDS@"
MARKS = {str(STEP_MARK).encode(): "step", b'"@RECENT@"': "recent", b'"@LAST@"': "last",
         b'"@PHASE@"': "phase", b'"@WAIT@"': "waiting", b'"@SECONDS@"': "seconds"}
_MARK_RE = re.compile(b"|".join(re.escape(m) for m in MARKS))
KEEP_STEPS = TIMING_WINDOW  # timing rows served, as a WorkerServer's step timer keeps
SECONDS_STEPS = RECENT_STEPS  # recent_step_seconds served, as a WorkerServer keeps
RANK_MARK, GROUP_MARK = 900000001, 900000002  # identity placeholders of the FR templates
FR_STEP = [("all_gather", [[300]]), ("all_gather", [[1000]]), ("reduce_scatter", [[1000]]),
           ("reduce_scatter", [[300]])]
MAX_REQUEST_HEAD = 64 * 1024


class VirtualRanks:
    def __init__(self, n: int, offset: int, group_size: int, step_s: float,
                 epoch: float | None = None) -> None:
        self.n, self.offset, self.group_size, self.step_s = n, offset, group_size, step_s
        # step 0's start (time.monotonic); processes of one job share it, or their groups would
        # be a fraction of a step apart: stopped by a hang, half of them one step behind the
        # others, which no real job in lockstep shows (the monitor drilled half the groups)
        self.t0 = time.monotonic() if epoch is None else epoch
        self.hung: dict[int, float] = {}  # rank -> monotonic onset
        self.slow: dict[int, tuple[int, float]] = {}  # group -> (first slow step, seconds)
        # (rank, packed) -> (pieces, marks)
        self.templates: dict[tuple[int, bool], tuple[list[bytes], tuple[str, ...]]] = {}
        self.requests = 0
        self.fr_templates: dict[tuple, bytes] = {}
        self._rows: dict[tuple, tuple[bytes, bytes]] = {}
        self._marks: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._fills: dict[tuple, list[bytes]] = {}  # values between a template's pieces
        self._routes: dict[bytes, tuple[str, int, str]] = {}  # request line -> what, rank, query

    def template(self, rank: int, packed: bool = False) -> tuple[list[bytes], tuple[str, ...]]:
        """The rank's /v1/state cut around its changing values: literal pieces, and between
        each two the name of the value that goes there (``packed``: as asked ``?packed=1``)."""
        t = self.templates.get((rank, packed))
        if t is None:
            g, gr = divmod(rank, self.group_size)
            s = rank_state(rank, g, step=STEP_MARK, step_seconds=self.step_s)
            s.update(group_rank=gr, group_world_size=self.group_size, host=f"node-{g}",
                     node=f"node-{g}", hostname=f"node-{g}", slurm_job_id=None, local_rank=gr,
                     device={"type": "cuda", "index": gr,
                             "uuid": f"GPU-{g:08x}-{gr:04x}-4c3a-9d1e-5b7f2a6c8e0d"},
                     replica_id=f"replica_group_{g}:virtual", commits=STEP_MARK,
                     phase=PHASE_MARK, recent_step_seconds=SECONDS_MARK, faults_struck_at={},
                     timing={"recent": RECENT_MARK, "waiting": WAIT_MARK, "last_step": LAST_MARK,
                             "window": None})
            if packed:
                s["packed"] = PACKED_FORMAT
            doc = json.dumps(s).encode()
            pieces, marks, at = [], [], 0
            for m in _MARK_RE.finditer(doc):
                pieces.append(doc[at:m.start()])
                marks.append(MARKS[m.group()])
                at = m.end()
            pieces.append(doc[at:])
            # every rank's marks come in the same order: one tuple, shared (a key of _fills)
            marks = self._marks.setdefault(tuple(marks), tuple(marks))
            t = self.templates[rank, packed] = (pieces, marks)
        return t

    def state(self, rank: int, since: int | None = None, recent: int | None = None,
              packed: bool = False) -> bytes:
        """The rank's ``/v1/state``; ``since``: ``timing.recent`` only after that step,
        ``recent``: ``recent_step_seconds`` only the newest N, ``packed``: both packed, as a
        WorkerServer serves ``?since=N``, ``?recent=N`` and ``?packed=1`` (worker_server/app.py)."""
        now = time.monotonic()
        g = rank // self.group_size
        if not self.hung:
            step = int((now - self.t0) / self.step_s)
            phase, waiting = b'"forward"', b"null"
        else:
            onset = min(self.hung.values())
            step = int((onset - self.t0) / self.step_s)
            waited = round(now - onset, 3)
            if rank in self.hung:
                phase, waiting = b'"forward"', b"null"
            elif any(h // self.group_size == g for h in self.hung):
                phase, waiting = b'"forward"', b'{"scope": "group", "seconds": %r}' % waited
            else:
                phase, waiting = b'"allreduce"', b'{"scope": "cross", "seconds": %r}' % waited
        pieces, marks = self.template(rank, packed)
        # the values between the pieces, in the template's order: the same for every rank with
        # the same step, rows and wait (all of them but the group's, in a healthy job)
        keep = KEEP_STEPS if since is None else max(0, min(KEEP_STEPS, step - since - 1))
        key = (marks, step, rank % 10, g if g in self.slow else -1,
               tuple(self.slow.items()) if self.slow else (), phase, waiting, keep, recent,
               packed)
        fill = self._fills.get(key)
        if fill is None:
            rows, last = self.rows(rank, step, keep, packed)
            values = {"step": str(step).encode(), "recent": rows, "last": last,
                      "phase": phase, "waiting": waiting,
                      "seconds": self.seconds(rank, step, recent, packed)}
            if len(self._fills) > 10_000:
                self._fills.clear()
            fill = self._fills[key] = [values[mark] for mark in marks]
        out = [b""] * (len(pieces) + len(fill))
        out[0::2] = pieces
        out[1::2] = fill
        return b"".join(out)

    def rows(self, rank: int, step: int, keep: int = KEEP_STEPS, packed: bool = False
             ) -> tuple[bytes, bytes]:
        """(``timing.recent``: the newest ``keep`` of its rows, ``timing.last_step``) of the rank
        at ``step``: the same for every rank with the same jitter (rank % 10) and slowness (its
        group slow or not). ``packed``: ``timing.recent`` packed (worker_server/packed.py)."""
        g = rank // self.group_size
        key = (rank % 10, step, g if g in self.slow else -1,
               tuple(self.slow.items()) if self.slow else (), keep, packed)
        got = self._rows.get(key)
        if got is None:
            if len(self._rows) > 10_000:
                self._rows.clear()
            steps = range(max(0, step - KEEP_STEPS), step)
            rows = [self.row(rank, s) for s in steps]
            last = (rows[-1] if rows else "null").encode()
            rows = rows[len(rows) - keep:] if keep else []
            if packed:
                recent = json.dumps(pack_timing_rows([json.loads(r) for r in rows])).encode()
            else:
                recent = f"[{', '.join(rows)}]".encode()
            got = self._rows[key] = (recent, last)
        return got

    def seconds(self, rank: int, step: int, recent: int | None = None, packed: bool = False
                ) -> bytes:
        """``recent_step_seconds`` of the rank at ``step``: the step times of its last 64
        steps (the newest ``recent``), as its timing rows have them (``packed``: packed)."""
        g = rank // self.group_size
        key = ("seconds", rank % 10, step, g if g in self.slow else -1,
               tuple(self.slow.items()) if self.slow else (), recent, packed)
        got = self._rows.get(key)
        if got is None:
            if len(self._rows) > 10_000:
                self._rows.clear()
            first = max(0, step - SECONDS_STEPS)
            if recent is not None:
                first = max(first, step - recent)
            vals = [sum(self.timing(rank, s)) for s in range(first, step)]
            got = self._rows[key] = json.dumps(pack_step_seconds(vals)).encode() if packed \
                else f"[{', '.join(map(repr, vals))}]".encode()
        return got

    def timing(self, rank: int, step: int) -> tuple[float, float, float]:
        """(compute, cross-group wait, in-group wait) seconds of one completed step: full
        floats, as a rank's clock measures them (~17 digits each in JSON)."""
        g = rank // self.group_size
        jitter = ((rank * 7 + step * 13) % 10) * 0.001
        fine = (((rank % 10) * 7 + step * 13) % 997 + 1) * 1.2345678901234567e-7  # last digits
        # as a WorkerServer's step timer has them: the step's seconds are its whole period
        # (step_s), compute the rest after the waits (worker_server/timing.py); a shorter step
        # time than the real period would make the schedule drill groups that are not stuck
        cross, group = 0.02 + jitter + fine, 0.01 + jitter / 2 + fine
        compute = self.step_s - cross - group + fine
        for h, (first, secs) in self.slow.items():
            if step >= first:
                if h == g:
                    compute += secs
                else:
                    cross += secs
        return compute, cross, group

    def row(self, rank: int, step: int) -> str:
        """One completed step's timing, as a WorkerServer's step timer serves it."""
        compute, cross, group = self.timing(rank, step)
        return (f'{{"step": {step}, "step_s": {compute + cross + group!r}, '
                f'"compute_s": {compute!r}, "wait_cross_s": {cross!r}, '
                f'"wait_group_s": {group!r}}}')

    def fr(self, rank: int, query: str) -> tuple[str, bytes]:
        """(status, body) of ``/v1/fr_trace`` for ``rank``; see the module docstring."""
        g, local = divmod(rank, self.group_size)
        hung = [h % self.group_size for h in self.hung if h // self.group_size == g]
        victim = hung[0] if hung else None
        key = (local, victim, query)
        body = self.fr_templates.get(key)
        if body is None:
            args = parse_qs(query)
            pg = args.get("pg", [None])[0]
            try:
                last = int(args["last"][0]) if "last" in args else None
            except ValueError:
                return "400 Bad Request", b'{"error": "last must be an integer"}'
            job = FRJob(world_size=self.group_size, flavour="gloo", jitter_ms=1,
                        compute_ms=self.step_s * 1000 / len(FR_STEP), seed=1)
            for _ in range(6):
                for op, sizes in FR_STEP:
                    job.collective("0", op, sizes)
            if victim is not None:
                job.collective("0", "all_gather", [[300]], absent=[victim])
            doc = job.dumps()[local]
            doc.update(rank=RANK_MARK, replica_group=GROUP_MARK, group_rank=local,
                       group_world_size=self.group_size, host=f"node-{GROUP_MARK}")
            body = json.dumps(doc).encode()
            if pg is not None or last is not None:
                body = filter_fr_dump(body, pg, last)
            self.fr_templates[key] = body
        return "200 OK", body.replace(str(RANK_MARK).encode(), str(rank).encode()) \
            .replace(str(GROUP_MARK).encode(), str(g).encode())

    def answer(self, request_line: bytes) -> tuple[bytes, bytes]:
        """(status, body) for one request line, e.g. ``GET /r/7/v1/state HTTP/1.1``."""
        self.requests += 1
        since = recent = None
        packed = False
        at = request_line.find(b"/v1/state?")
        if at >= 0:  # a monitor's per-rank query (a new value every step): not in the routes
            at += len(b"/v1/state")  # at the "?"
            end = request_line.find(b" ", at)
            for part in request_line[at + 1:end if end >= 0 else None].split(b"&"):
                name, _, value = part.partition(b"=")
                if name == b"packed":
                    packed = BOOL_WORDS.get(value.decode("latin-1").strip().lower())
                    if packed is None:
                        return b"400 Bad Request", b'{"error": "packed must be true or false"}'
                    continue
                if name not in (b"since", b"recent"):
                    continue  # as Flask does: a parameter nobody reads
                try:
                    n = int(value)
                except ValueError:
                    n = None
                if name == b"since":
                    if n is None:
                        return b"400 Bad Request", b'{"error": "since must be an integer"}'
                    since = n
                else:
                    if n is None or not 0 <= n <= MAX_RECENT:
                        return b"400 Bad Request", b'{"error": "recent must be an integer"}'
                    recent = n
            request_line = request_line[:at] + (request_line[end:] if end >= 0 else b"")
        route = self._routes.get(request_line)  # each rank asks the same line every sweep
        if route is None:
            route = self.route(request_line)
            if len(self._routes) > 1_000_000:
                self._routes.clear()
            self._routes[request_line] = route
        what, rank, query = route
        if what == "state":
            return b"200 OK", self.state(rank, since, recent, packed)
        if what == "fr_trace":
            status, body = self.fr(rank, query)
            return status.encode(), body
        return b"404 Not Found", b'{"error": "not found"}'

    def state_asked(self, rank: int, query: str = "") -> bytes:
        """The rank's ``/v1/state`` as asked with ``query`` (a monitor's per-URL query: ``""``
        or ``"?since=N&recent=M&packed=1"``), read as a request to this server is; ValueError for a
        query it answers 400."""
        status, body = self.answer(b"GET /r/%d/v1/state%s HTTP/1.1" % (rank, query.encode()))
        if status != b"200 OK":
            raise ValueError(body.decode())
        return body

    def route(self, request_line: bytes) -> tuple[str, int, str]:
        """(``state``, ``fr_trace`` or ``""`` for not found, rank, query) of a request line."""
        parts = request_line.split()
        target = parts[1].decode("latin-1") if len(parts) > 1 else "/"
        path, _, query = target.partition("?")
        bits = path.split("/")  # '', 'r', '<rank>', 'v1', 'state' | 'fr_trace'
        if len(bits) == 5 and bits[1] == "r" and bits[3] == "v1" and bits[4] in (
                "state", "fr_trace"):
            try:
                rank = int(bits[2])
            except ValueError:
                rank = -1
            if self.offset <= rank < self.offset + self.n:
                return bits[4], rank, query
        return "", -1, ""

    def protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (``loop.create_server(vr.protocol, ...)``)."""
        return _Connection(self)


class _Connection(asyncio.Protocol):
    """One keep-alive client: answers each request as soon as its head is in."""

    def __init__(self, ranks: VirtualRanks) -> None:
        self.ranks = ranks
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            skip = 4
            if end < 0:
                end, skip = buf.find(b"\n\n"), 2
            if end < 0:
                if len(buf) > MAX_REQUEST_HEAD:
                    self.transport.close()
                    buf = b""
                break
            eol = buf.find(b"\n")
            status, body = self.ranks.answer(buf[:eol])
            self.transport.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))
            buf = buf[end + skip:]
        self.buf = buf


async def serve(args: argparse.Namespace) -> None:
    vr = VirtualRanks(args.ranks, args.offset, args.group_size, args.step_s, args.epoch)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(vr.protocol, "127.0.0.1", 0, backlog=4096)
    print(f"VRANKS {server.sockets[0].getsockname()[1]}", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = line.decode().split()
        if cmd[:1] == ["hang"] and len(cmd) == 2:
            vr.hung[int(cmd[1])] = time.monotonic()
        elif cmd[:1] == ["slow"] and len(cmd) == 3:
            step = int((time.monotonic() - vr.t0) / vr.step_s) + 1
            vr.slow[int(cmd[1])] = (step, float(cmd[2]))
            # when the slowness begins (time.monotonic, one clock for every process here): a
            # benchmark counts the straggler's steps from it, not from the command
            print(f"SLOW {step} {vr.t0 + step * vr.step_s:.6f}", flush=True)
        elif cmd[:1] == ["heal"]:
            vr.hung.clear()
            vr.slow.clear()
    server.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.5)
    p.add_argument("--epoch", type=float, default=None,
                   help="time.monotonic() of step 0, shared by the processes of one job")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="uvloop where installed (auto): ~half the CPU a request costs the "
                        "stdlib loop, on the cores the monitor shares at 100,000 ranks")
    args = p.parse_args()
    loop = new_event_loop(args.event_loop)
    try:
        loop.run_until_complete(serve(args))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
