"""The torch x torchft version matrix, as nox sessions (``pip install nox``; ``bin/bootstrap``
puts it in .venv).

Every session makes a virtual environment of its own under ``.nox/``, installs torch first and
pinned (an unpinned or ranged torch pulls a multi-GB CUDA build), then one torchft, Lightkeeper's
``[worker]`` and ``[monitor]`` extras and pytest, and runs ``tests/test_torchft_versions_e2e.py``
on that Python:
examples/torchft_two_groups.py as two replica groups (one under ``lightkeeper run``, one with
``WorkerServer.start(manager)``), a real Lighthouse, ``lightkeeper monitor``; it checks the hook,
the rank endpoints, the Flight Recorder incarnations, the versions reported and the monitor
verifying every rank.

    .venv/bin/nox                    # the default sessions: torch 2.13.0 x {torchft 0.2.0, nightly}
    .venv/bin/nox -l                 # every session
    .venv/bin/nox -s floor           # opt-in: torch 2.8.0 + torchft 0.2.0 (torchft's floor)
    .venv/bin/nox -s newest          # opt-in: torch 2.15.0 (a CUDA build, ~5 GB) x both torchfts

``bin/test`` runs neither nox nor the opt-in sessions: its own .venv covers the default pair
(nightly unpacked beside 0.2.0). What the opt-in sessions cost and how they did:
benchmarks/results/version_matrix.json.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
NIGHTLY_PIN = ROOT / ".ci" / "torchft-nightly.txt"  # the one place the nightly build is pinned
TEST = "tests/test_torchft_versions_e2e.py"
DEFAULT_TORCH = "2.13.0"  # bin/bootstrap's; on a machine whose pip has no CPU wheel: CUDA
# torchft's floor in practice: torchft 0.2.0 declares torch>=2.7, but its ProcessGroupGloo sets
# the gloo options' global_ranks_in_group, which torch 2.7.1 lacks (every quorum fails there)
FLOOR_TORCH = "2.8.0"
NEWEST_TORCH = "2.15.0"  # the newest on PyPI: a CUDA build
TORCHFTS = ["0.2.0", "nightly"]

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True


def torchft_requirement(torchft: str) -> list[str]:
    if torchft == "nightly":
        return ["-r", str(NIGHTLY_PIN)]
    return [f"torchft=={torchft}"]


def run_matrix_test(session: nox.Session, torch: str, torchft: str) -> None:
    session.install(f"torch=={torch}")  # first: nothing after it may pick another torch
    session.install(*torchft_requirement(torchft))
    # pytest-xdist: tests/conftest.py implements one of its hooks, which pytest refuses without it
    session.install(".[worker,monitor]", "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5")
    session.run("python", "-c", "import torch, torchft; print('torch', torch.__version__, "
                "'torchft from', torchft.__file__)")
    # this_python: the session's own torch and torchft (no torchft-nightly directory beside it)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST,
                "-k", "this_python", *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("torchft", TORCHFTS)
def default(session: nox.Session, torchft: str) -> None:
    """torch 2.13.0 (CPU on this project's machines) x torchft 0.2.0 / the pinned nightly."""
    run_matrix_test(session, DEFAULT_TORCH, torchft)


@nox.session(python="3.11", default=False)
def floor(session: nox.Session) -> None:
    """torchft's floor: torch 2.8.0 (the lowest its ProcessGroupGloo works on) with 0.2.0."""
    run_matrix_test(session, FLOOR_TORCH, "0.2.0")


@nox.session(python="3.11", default=False)
@nox.parametrize("torchft", TORCHFTS)
def newest(session: nox.Session, torchft: str) -> None:
    """The newest torch on PyPI, 2.15.0: a CUDA build (~5 GB installed), run on CPU/gloo."""
    run_matrix_test(session, NEWEST_TORCH, torchft)
