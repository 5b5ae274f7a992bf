"""Lightkeeper's import hook, loaded by Python at start-up from ``PYTHONPATH``.

``lightkeeper run`` puts this directory first on ``PYTHONPATH``. With ``LIGHTKEEPER_AUTOSTART=1``
it installs :mod:`worker_server.autostart`'s hook (a WorkerServer for every torchft Manager),
then runs the ``sitecustomize`` this file shadows, if the environment has one. It imports neither
torch nor torchft, and never stops the interpreter: a failure is one line on stderr.
"""


def _lightkeeper_hook() -> None:
    import sys

    try:
        from worker_server import autostart
    except Exception as e:  # lightkeeper[worker] is not installed in the job's Python
        line = (f"[lightkeeper] autostart: cannot import worker_server in {sys.executable} "
                f"({type(e).__name__}: {e}); install lightkeeper[worker] into the job's "
                "environment. Training goes on without a WorkerServer.\n")

        class SayOnTorchft:  # said where torchft is used: other processes have nothing to serve
            def find_spec(self, name, path=None, target=None):
                if name == "torchft.manager" and self in sys.meta_path:
                    sys.meta_path.remove(self)
                    sys.stderr.write(line)
                return None

        sys.meta_path.insert(0, SayOnTorchft())
        return
    try:
        autostart.install_if_enabled()
    except Exception as e:
        autostart.say(f"autostart: hook not installed ({type(e).__name__}: {e})")


def _chain() -> None:
    """Run the sitecustomize this one shadows (the next on sys.path), as Python would have."""
    import importlib.machinery
    import os
    import sys

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    import importlib.util  # only now: 4 ms at every interpreter start

    module = importlib.util.module_from_spec(spec)
    sys.modules["_lightkeeper_chained_sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # as Python reports a failing sitecustomize: a line, then go on
        sys.stderr.write(f"[lightkeeper] the environment's own sitecustomize ({spec.origin}) "
                         f"failed: {type(e).__name__}: {e}\n")


_lightkeeper_hook()
_chain()
