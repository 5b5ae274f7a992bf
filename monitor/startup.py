"""What a monitor checks and builds before its loop: the configuration against each stage's own
grammar (:func:`check_config`, also the CLI's), who may register without a token, the
quarantine's sinks, and the clock its durations are measured on."""

from __future__ import annotations

import os
import time

from http_serving import is_http_url, redact_url

from .act.sinks import SinkConfigError, build_sink, validate_action
from .config import ConfigError, MonitorConfig
from .poll.admission import AllowList
from .poll.discovery import check_sd_out, normalize_url


def allow_list(cfg: MonitorConfig) -> AllowList:
    """Who may register without the token (raises ValueError on a bad entry)."""
    if cfg.allow_targets is None:
        return AllowList.default(cfg.targets)
    return AllowList.parse(cfg.allow_targets)


def check_config(cfg: MonitorConfig) -> None:
    """``cfg.validate()`` and the checks of each stage's own grammar; raises ConfigError."""
    cfg.validate()
    if not cfg.state_path:  # SQLite's "" is a private temporary file: the audit log lost
        raise ConfigError("--state: empty; name the audit log's file")
    if cfg.job is not None and not cfg.job.strip():  # every rank's job refused, no job label
        raise ConfigError("--job: empty; name the training job")
    if cfg.sd_out:  # its atomic replace would destroy the file it names
        sd_out = os.path.realpath(cfg.sd_out)
        state = os.path.realpath(cfg.state_path)
        taken = {state: "--state", **{state + x: f"--state's {x}" for x in
                                      ("-wal", "-shm", "-journal", ".lock")}}
        if cfg.targets_file:  # its own output read back as listed targets, never forgotten
            taken[os.path.realpath(cfg.targets_file)] = "--targets-file"
        if sd_out in taken:
            raise ConfigError(f"--sd-out {cfg.sd_out} is this monitor's {taken[sd_out]}: "
                              "name a file of its own")
    if cfg.lighthouse and not is_http_url(cfg.lighthouse):
        raise ConfigError(f"--lighthouse {redact_url(cfg.lighthouse)!r}: not an "
                          "http(s)://host:port URL")
    for t in cfg.targets:  # before the allow-list, which their hosts join
        try:
            normalize_url(t)  # e.g. an IPv6 literal without brackets: said here, not a crash
        except ValueError as e:
            raise ConfigError(f"--targets entry {redact_url(t)!r}: {e}") from None
    try:
        allow_list(cfg)
        for a in cfg.quarantine.actions:
            validate_action(a)
    except (ValueError, SinkConfigError) as e:  # BadTarget is a ValueError
        raise ConfigError(str(e)) from None


def build_sinks(cfg: MonitorConfig) -> list:
    """The quarantine's sinks, one per ``--action`` (raises ConfigError)."""
    try:
        return [build_sink(a, cfg.quarantine) for a in cfg.quarantine.actions]
    except SinkConfigError as e:
        raise ConfigError(str(e)) from None


def check_paths(cfg: MonitorConfig) -> None:
    """Refuse (ConfigError) the bundles' folder (``--bundle-dir``, or incidents/ beside --state)
    when it cannot be made or written, or is the --state file or in it, and an ``--sd-out``
    that is not file_sd JSON, making nothing: a refused start leaves no --state behind. (The
    default's missing folders are --state's, whose own trouble hold_state says: exit 1.)"""
    d = cfg.bundles.directory(cfg.state_path) if cfg.bundles.enabled else None
    if d:
        said = f"--bundle-dir {d}" if cfg.bundles.dir else \
            f"the bundles' default folder {d} (beside --state)"
        real, state = os.path.realpath(d), os.path.realpath(cfg.state_path)
        if cfg.state_path != ":memory:" and (real == state or real.startswith(state + os.sep)):
            raise ConfigError(f"{said}: {cfg.state_path} is --state's file; name a folder of "
                              "the bundles' own (--bundle-dir)")
        if cfg.sd_out and os.path.realpath(cfg.sd_out) == real:
            raise ConfigError(f"{said}: it is --sd-out's file; name a folder of the bundles' own")
        up = os.path.abspath(d)
        while cfg.bundles.dir and not os.path.lexists(up):  # the rest is made in the nearest
            up = os.path.dirname(up)
        if os.path.lexists(up) and not (os.path.isdir(up) and os.access(up, os.W_OK | os.X_OK)):
            raise ConfigError(f"{said}: {up} is not a "
                              f"{'writable ' if os.path.isdir(up) else ''}folder")
    if cfg.sd_out:
        check_sd_out(cfg.sd_out)


def steady_clock():
    """Unix time that never steps: the wall clock at start plus seconds since on a clock that
    NTP does not step (a suspended host's time counted), so a clock set back or forward while
    the monitor runs moves none of its durations."""
    boot = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    offset = time.time() - time.clock_gettime(boot)
    return lambda: offset + time.clock_gettime(boot)
