"""Only what pyproject.toml cannot say: ship ``lightkeeper-autostart.pth`` at the top of
site-packages (setuptools' package data cannot place a file there), build the analyzer's C
reader of dump pickles (``monitor/analysis/_frpickle.c``, docs/stack.md).

The .pth line is a no-op unless ``LIGHTKEEPER_AUTOSTART=1``; then it installs the import hook of
:mod:`worker_server.autostart` in every Python process of the environment (docs/run.md,
"Containers"). An editable install (``pip install -e``) does not get it.

The C reader is optional: where it does not compile (no compiler, no Python headers) the install
goes on without it and ``lightkeeper analyze`` reads every pickle with Python's unpickler, with
the same results (its JSON says which reader ran). An editable install builds it in place, next
to its source.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = os.path.join("worker_server", "autostart_site", "lightkeeper-autostart.pth")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)),
                           preserve_mode=False)


FRPICKLE = Extension(
    "monitor.analysis._frpickle",
    sources=[os.path.join("monitor", "analysis", "_frpickle.c")],
    extra_compile_args=["-O2"],
    optional=True,  # a failed compile warns and leaves the pure-Python reader
)

setup(cmdclass={"build_py": BuildPyWithPth}, ext_modules=[FRPICKLE])
