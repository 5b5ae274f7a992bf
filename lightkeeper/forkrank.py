"""A torchrun worker forked from an agent that imported the trainer first (the demo's groups).

:class:`~lightkeeper.cluster.LocalCluster` with ``fork_ranks`` runs torchrun as
``--run-path --start-method fork`` with this file as the training script: the agent
(``cluster.TORCHRUN_SCRIPT``) imports torch, torchft and the trainer and takes the first
optimizer step's lazy imports once (:func:`preload`), then forks its ranks, which run
``lightkeeper train`` without importing any of it again. Each rank is still a process of its
own, the agent's child, as under plain torchrun; it skips the interpreter start and the imports.
A warm spare's rank (``--spare GO READY`` first) says it is ready at once, waits for the go file
and takes its host from it (:func:`await_go`, which ``cluster.SPARE_SCRIPT`` runs too).

torchrun's multiprocessing context needs a rank that succeeds to return (its return value ends
the group's run), so :func:`main` returns on exit code 0 where ``lightkeeper train`` would
``os._exit``; any other code still ends the process at once.
"""

from __future__ import annotations

import os
import sys
import time

PRELOAD = ("torch.distributed", "torch.distributed.device_mesh", "torch.distributed.fsdp",
           "torchft", "torchft.checkpointing.http_transport", "torchft.optim",
           "worker_server", "worker_server.instrument", "worker_server.server",
           "trainer.cli", "trainer.loop", "trainer.model", "trainer.parallel", "trainer.store",
           "lightkeeper.cli")


def preload() -> None:
    """What every rank would import, and what its first step would load lazily (torch.optim
    and FSDP pull in torch._dynamo), done once in the agent before it forks."""
    import importlib

    import torch

    for name in PRELOAD:
        importlib.import_module(name)
    torch.set_num_threads(1)  # the ranks' own setting; no thread pool to fork over
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    (p * 2.0).sum().backward()
    opt.step()
    del p, opt


class _Ended(BaseException):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _end(code: int):
    """``trainer.loop.end_process`` in a forked rank: flushed, atexit run, then raised to
    :func:`main`, which returns on 0 (torchrun reads the return) and exits at once otherwise."""
    import atexit

    atexit._run_exitfuncs()
    raise _Ended(code)


def await_go(go: str, ready: str) -> list[str]:
    """A warm spare's rank: ready now, then wait for the go file (or exit when whoever started
    the spare is gone); then take the host and arguments it names."""
    import json

    with open(ready + f".{os.getpid()}", "w") as f:
        f.write(str(time.time()))
    owner = int(os.environ["LIGHTKEEPER_SPARE_OWNER"])
    checked = time.monotonic()
    while not os.path.exists(go):
        if time.monotonic() - checked > 0.5:
            checked = time.monotonic()
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                os._exit(0)  # never train unsupervised
        time.sleep(0.02)
    with open(go) as f:
        placed = json.loads(f.read() or "{}")
    if placed.get("netns"):  # its host is a network namespace: move there first
        from lightkeeper.netns import enter_host

        enter_host(placed["netns"], placed["node"])
    os.environ.update(placed.get("env") or {})
    return placed.get("args") or []


def main(argv: list[str]) -> int:
    import signal

    import trainer.loop
    from lightkeeper import cli

    # the agent's handlers (torchrun raises SignalException on these): a rank starts with
    # Python's own, as an exec'd one does, and arms its SIGTERM watcher over SIG_DFL
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if argv[:1] == ["--spare"]:
        from worker_server.stop_signal import watch_sigterm

        watch_sigterm()  # as `lightkeeper train` does, before the wait
        go, ready, argv = argv[1], argv[2], argv[3:]
        argv = [*argv, *await_go(go, ready)]
    trainer.loop.end_process = _end
    sys.argv = ["lightkeeper", *argv]
    try:
        code = int(cli.main(argv) or 0)
    except _Ended as e:
        code = e.code
    except SystemExit as e:  # argparse's, a usage error
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code:
        os._exit(code)
    return 0


if __name__ == "__main__":  # torchrun --run-path runs this file in the forked rank
    main(sys.argv[1:])
