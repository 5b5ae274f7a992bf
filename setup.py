"""Only what pyproject.toml cannot say: ship ``lightkeeper-autostart.pth`` at the top of
site-packages (setuptools' package data cannot place a file there).

The .pth line is a no-op unless ``LIGHTKEEPER_AUTOSTART=1``; then it installs the import hook of
:mod:`worker_server.autostart` in every Python process of the environment (docs/run.md,
"Containers"). An editable install (``pip install -e``) does not get it.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = os.path.join("worker_server", "autostart_site", "lightkeeper-autostart.pth")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)),
                           preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithPth})
