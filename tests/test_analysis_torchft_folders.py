"""``lightkeeper analyze`` on torchft's per-quorum folders as torch writes them for a job of
2 replica groups x 2 ranks on one shared filesystem.

torchft (``Manager._update_fr_path``) sets ``TORCH_FR_DUMP_TEMP_FILE`` to
``<prefix>_quorum_<q>/<global_rank>``, global rank = replica id's trailing number x group size +
group rank; torch writes that name as is with ``TORCH_FR_DUMP_DYNAMIC_FILE_NAME=1``, else appends
its own rank (the first NCCL group's: the group rank where each replica group has its own world).
torch's dump has no ``rank`` key; its default group ``"0"`` lists ranks within the replica group.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from lightkeeper.cli import main
from tests.support.frgen import FRJob

GROUP_SIZE = 2
QUORUM = 5


def ft_name(group_rank: int) -> str:
    return f"torchft_quorum_{QUORUM}_rank_{group_rank}"


def torch_dumps() -> dict[int, dict]:
    """Per global rank, the dump torch writes: each replica group trains with its own default
    group (replica group 1 healed: its sequence ids restarted, so they disagree with group 0's),
    and in torchft's group of group rank 1 global rank 3 never joined the last all_reduce."""
    job = FRJob(4, flavour="nccl", seed=7)
    for gr in range(GROUP_SIZE):
        job.group(ft_name(gr), [gr, GROUP_SIZE + gr], desc="undefined")
    for step in range(6):
        job.collective("0", "all_gather", [[1024]], members=[0, 1])
        job.collective("0", "broadcast" if step == 0 else "all_gather", [[1024]], members=[2, 3])
        for gr in range(GROUP_SIZE):
            job.collective(ft_name(gr), "all_reduce", [[4096]])
    job.collective(ft_name(1), "all_reduce", [[4096]], absent=[3])
    dumps = job.dumps(fmt="pickle")
    for d in dumps.values():
        assert "rank" not in d  # torch's own dumps never say it
        d["pg_config"]["0"]["ranks"] = str(list(range(GROUP_SIZE)))  # numbered within its world
    return dumps


def write(folder: Path, dumps: dict[int, dict], name) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, dump in dumps.items():
        (folder / name(rank)).write_bytes(pickle.dumps(dump, protocol=2))


def analyze_json(capsys, path: Path) -> tuple[int, dict]:
    code = main(["analyze", "--format", "json", "--jobs", "1", str(path)])
    return code, json.loads(capsys.readouterr().out)


def only_the_real_hang(report: dict) -> None:
    assert report["ranks"] == [0, 1, 2, 3] and report["unknown_ranks"] == []
    assert [(f["kind"], f["pg"], f["culprit_ranks"], f.get("waiting_ranks")) for f in report["findings"]] == [
        ("hang", ft_name(1), [3], [1])]


def test_dynamic_names_replica_groups_own_groups_are_never_compared(tmp_path, capsys):
    """Files named ``<global_rank>``: group ``"0"`` of each replica group is its own, so their
    restarted sequence ids are no mismatch; torchft's group is analyzed across them."""
    (tmp_path / "fr_quorum_-1").mkdir()  # torchft makes it at start, before any quorum
    write(tmp_path / f"fr_quorum_{QUORUM}", torch_dumps(), str)
    code, report = analyze_json(capsys, tmp_path / "fr")
    assert code == 1, report
    only_the_real_hang(report)
    [read] = [q for q in report["torchft_quorums"] if q["read"]]
    assert read["quorum_id"] == QUORUM
    assert any("dumps of 2 replica group(s) (0, 1)" in n for n in read["notes"]), read
    main(["analyze", str(tmp_path / "fr")])
    assert "  note: dumps of 2 replica group(s)" in capsys.readouterr().out


def test_names_with_torchs_rank_appended_are_read_as_global_ranks(tmp_path, capsys):
    """Without ``TORCH_FR_DUMP_DYNAMIC_FILE_NAME`` torch appends its rank (the group rank):
    ``00``, ``11``, ``20``, ``31`` are global ranks 0-3, not ranks 11, 20 and 31."""
    write(tmp_path / f"fr_quorum_{QUORUM}", torch_dumps(), lambda r: f"{r}{r % GROUP_SIZE}")
    code, report = analyze_json(capsys, tmp_path / "fr")
    assert code == 1, report
    only_the_real_hang(report)
    [read] = [q for q in report["torchft_quorums"] if q["read"]]
    assert any("TORCH_FR_DUMP_DYNAMIC_FILE_NAME unset" in n for n in read["notes"]), read


def test_a_name_that_could_be_two_ranks_is_an_error_not_a_guess(tmp_path, capsys):
    dumps = torch_dumps()
    # global rank 1's dump under a name whose splits are both its groups' members: 1|1 and 11|?
    dumps[1]["pg_config"][ft_name(1)]["ranks"] = "[1, 11]"
    write(tmp_path / f"fr_quorum_{QUORUM}", dumps, lambda r: f"{r}{r % GROUP_SIZE}" if r != 1 else "111")
    code, report = analyze_json(capsys, tmp_path / "fr")
    assert 1 not in report["ranks"] and 11 not in report["ranks"] and 111 not in report["ranks"]
    assert any(e["path"].endswith("111") and "cannot tell its rank" in e["error"] for e in report["errors"]), report


def test_replica_groups_sharing_global_ranks_are_not_read(tmp_path, capsys):
    """Replica ids without a trailing number: torchft's global rank is the group rank for every
    group, so both groups' rank r wrote file r; which group's dump is left cannot be told."""
    dumps = torch_dumps()
    for d in dumps.values():
        for name, cfg in d["pg_config"].items():
            if name.startswith("torchft_"):
                cfg["ranks"] = str([int(name[-1])] * 2)
    write(tmp_path / f"fr_quorum_{QUORUM}", {0: dumps[0], 1: dumps[3]}, str)
    code, report = analyze_json(capsys, tmp_path / "fr")
    assert code == 2 and report["ranks"] == [] and report["findings"] == []
    [error] = report["errors"]
    assert "same global rank(s) 0, 1" in error["error"] and "cannot be told" in error["error"], error
