"""The Lighthouse's ``/status`` page, hostile: parsed in time linear in its size.

The monitor reads the page inside its sweep, so a page its regular expressions backtracked on
stopped every sweep: whitespace before a member's ``<br/>`` was cubic (2 KB: 7 s; 5 KB: a
minute; the monitor reads up to 16 MiB). A real torchft Lighthouse cannot be made to serve such
a page, so the first test's Lighthouse is a fake HTTP server; the monitor is real.
"""

from __future__ import annotations

import sys
import time

import pytest
import requests

from lightkeeper.processes import start_monitor_process, stop_process, wait_until
from monitor.evidence.lighthouse_status import StatusFormatError, parse_status
from tests.support.http_stub import HttpStub
from tests.support.monitor_sim import SimRanks

HEAD = ("Current quorum_id: 3 <br><h3>Previous Quorum</h3>Previous quorum id: 3 <br> "
        "Num participants: 1 <br>")
MEMBER = '<div class="member"><b>g0:x</b><br/>Step: 1<br/>'
HOSTILE = {
    "manager": HEAD + MEMBER + "Manager:" + " " * 4000 + "x<h2>Heartbeats</h2>",
    "store": HEAD + MEMBER + "Manager: a<br/>TCPStore:" + " " * 4000 + "x<h2>Heartbeats</h2>",
    "member class": HEAD + '<div class="member' + " " * 40000 + "x<h2>Heartbeats</h2>",
    "member blocks": HEAD + '<div class="member"><b>x' * 20000 + "<h2>Heartbeats</h2>",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_status_page_is_refused_at_once(name):
    t0 = time.monotonic()
    with pytest.raises(StatusFormatError):
        parse_status(HOSTILE[name])
    assert time.monotonic() - t0 < 1.0


def test_a_member_block_is_read_as_before():
    page = (HEAD + '<div class="member recovering">\n  <b>g0:a&amp;b</b> <br/>\n  Step: 7 <br/>\n'
            "  Manager: http://h:1/m <br/>\n  TCPStore: h:2 <br/>\n  World size: 2 <br/>\n"
            '</div><h2>Heartbeats</h2><li class="heartbeat\n old\n ">\n g0:a&amp;b: seen 2.5s ago'
            "\n</li>")
    st = parse_status(page)
    m = st.members["g0:a&b"]
    assert (st.quorum_id, m.step, m.store, m.world_size) == (3, 7, "h:2", 2)
    assert st.heartbeats == {"g0:a&b": 2.5} and st.stale == {"g0:a&b"}


def test_the_monitor_sweeps_on_while_the_lighthouse_serves_a_hostile_page(tmp_path):
    lighthouse = HttpStub({"GET": (200, HOSTILE["manager"], {"Content-Type": "text/html"})})
    sim = SimRanks.start(1)
    proc = None
    try:
        proc, url = start_monitor_process(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--interval",
             "0.2", "--targets", sim.urls[0], "--lighthouse", lighthouse.url, "--state",
             str(tmp_path / "state.sqlite")], tmp_path / "out.log", tmp_path / "err.log")
        wait_until(lambda: requests.get(url + "/healthz", timeout=5).json()["sweeps"] >= 3, 15,
                   what="three sweeps")
        cluster = requests.get(url + "/v1/cluster", timeout=5).json()
        error = cluster["verification"]["lighthouse_error"]
        assert "member blocks" in error, error
    finally:
        if proc is not None:
            stop_process(proc)
        sim.stop()
        lighthouse.close()
