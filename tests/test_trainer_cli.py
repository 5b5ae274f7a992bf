"""`lightkeeper train`'s flags and their documented environment fallbacks (docs/trainer.md)."""

from __future__ import annotations

import argparse

from trainer.cli import add_arguments, config_from_args


def parse(argv: list[str]):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--lighthouse", "http://127.0.0.1:29510", *argv]))


def test_worker_host_and_port_fall_back_to_the_environment(monkeypatch):
    monkeypatch.delenv("LIGHTKEEPER_WORKER_HOST", raising=False)
    monkeypatch.delenv("LIGHTKEEPER_WORKER_PORT", raising=False)
    cfg = parse([])
    assert (cfg.worker_host, cfg.worker_port) == ("127.0.0.1", 0)
    monkeypatch.setenv("LIGHTKEEPER_WORKER_HOST", "0.0.0.0")
    monkeypatch.setenv("LIGHTKEEPER_WORKER_PORT", "9600")
    cfg = parse([])
    assert (cfg.worker_host, cfg.worker_port) == ("0.0.0.0", 9600)
    cfg = parse(["--worker-host", "127.0.0.2", "--worker-port", "0"])  # a flag wins
    assert (cfg.worker_host, cfg.worker_port) == ("127.0.0.2", 0)
