"""The ``lightkeeper`` command: one subcommand per package.

Each subcommand lives in the package that owns it and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their subcommand is chosen, so ``lightkeeper analyze`` does not pay for
importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainer.cli", "run one rank of a torchft replica group with a WorkerServer"),
    "run": ("lightkeeper.run", "run any torchft job with a WorkerServer on every rank, no code "
                               "change: lightkeeper run -- COMMAND"),
    "demo": ("lightkeeper.demo", "run a whole fault-tolerant job with faults, monitor and report"),
    "monitor": ("monitor.cli", "poll every rank, detect bad replica groups and evict them"),
    "analyze": ("monitor.analysis.cli", "analyze Flight Recorder dumps across ranks"),
    "dashboards": ("dashboards.cli", "build, validate and upload Grafana dashboards"),
}
# What the `monitor` extra brings: a core install (a rank's `[worker]`) leaves them out
MONITOR_EXTRA = {"numpy", "msgspec", "promql_parser"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = argparse.ArgumentParser(prog="lightkeeper", description="Lightkeeper: observability and auto-eviction for torchft training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    try:
        parsers = {}
        for name, (module_name, help_text) in SUBCOMMANDS.items():
            p = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
            if name == chosen:
                importlib.import_module(module_name).add_arguments(p)
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would blame the top level and print its usage, not the command's
            parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
        return int(module.run(args) or 0)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in MONITOR_EXTRA:
            raise
        print(f"lightkeeper {chosen}: needs {e.name}, which the core install leaves out: "
              "pip install 'lightkeeper[monitor]'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `| head` stopped reading: nothing more to say (128 + SIGPIPE)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
