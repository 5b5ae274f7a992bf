"""HTTP plumbing shared by the WorkerServer and the monitor, at the bottom of the import graph.

It imports only the standard library and waitress: ``worker_server`` and ``monitor`` depend on
it, the application package ``lightkeeper`` (CLI, demo) depends on them, never the reverse.
"""

from .auth import bearer_token_matches
from .params import decimal_int
from .text import on_command_line, printable
from .urls import (
    failure_reason,
    host_for_url,
    http_url,
    is_http_url,
    is_loopback_host,
    is_monitor_url,
    redact_entry,
    redact_url,
    split_host_port,
    url_list,
)
from .wsgi import BackgroundWSGIServer

__all__ = ["BackgroundWSGIServer", "bearer_token_matches", "decimal_int", "failure_reason",
           "host_for_url", "http_url", "is_http_url", "is_loopback_host", "is_monitor_url",
           "on_command_line", "printable", "redact_entry", "redact_url", "split_host_port", "url_list"]
