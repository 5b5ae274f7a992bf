"""Incident bundles of faults on a real torchft-nightly job, read by ``lightkeeper analyze``.

The bundles in tests/data (README there) are what the monitor kept before it evicted group 1 of a
3 x 2 gloo job on torchft-nightly (torch 2.13: torchft's cross-group group is named ``''`` on
every group rank; its incarnations come from ``reconfigure``). A cross-group hang of a whole
group is one finding per torchft group (one per group rank), each naming that group's rank: the
analysis names the monitor's ranks only together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightkeeper.cli import main

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("bundle, named, culprits", [
    # hang:at_step=N,where=group,rank=1: rank 3 never enters FSDP's all-gather rank 2 waits in
    # (rank 2, behind in the cross-group collective, is blocked by that hang: no culprit)
    ("nightly_group_hang_bundle.tar.gz", [3], [[], [3], [3]]),
    # hang:at_step=N,where=cross: neither rank of group 1 enters the cross-group all_reduce
    ("nightly_cross_hang_bundle.tar.gz", [2, 3], [[2], [3]]),
])
def test_the_analysis_of_a_nightly_hang_bundle_agrees_with_the_monitor(bundle, named, culprits,
                                                                       capsys):
    main(["analyze", "--format", "json", "--jobs", "1", str(DATA / bundle)])
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == [0, 1, 2, 3, 4, 5] and report["errors"] == []
    hangs = [f for f in report["findings"] if f["kind"] == "hang"]
    assert sorted(f["culprit_ranks"] for f in hangs) == culprits
    assert all(f["culprit_ranks"] or f["blocked_by"] for f in hangs)  # none only when blocked
    b = report["bundles"][0]
    assert (b["kind"], b["culprit_ranks"], b["analysis_agrees"]) == ("hang", named, True), b
