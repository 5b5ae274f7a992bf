"""A real Prometheus server for tests: see :mod:`lightkeeper.prometheus` (the demo's, too).

Use ``tests.conftest.require_binary("prometheus")`` first to skip/fail clearly when it is missing.
"""

from lightkeeper.prometheus import (  # noqa: F401
    PrometheusError,
    PrometheusServer,
    binary,
    start,
    static_config,
)
