#!/usr/bin/env bash
# A Python for TorchTitan's debug model on CPU (tests/test_torchtitan.py's opt-in test,
# docs/torchtitan.md): torch 2.13.0 first, then torchft 0.2.0, torchtitan 0.3.0 with all its
# dependencies, triton (torchtitan 0.3.0 imports it unconditionally, through
# torchtitan/distributed/minimal_async_ep/kernels.py; a CUDA torch wheel brings it, the CPU one
# does not), and this checkout's lightkeeper[worker] (editable). About 2.6 GB with torch's CPU
# build, which pip gets only from PyTorch's CPU index (PIP_EXTRA_INDEX_URL); PyPI's Linux wheel
# is the CUDA build, ~5 GB more (docs/install.md).
#
#   examples/torchtitan/make_venv.sh /tmp/tt-venv
#   LIGHTKEEPER_TORCHTITAN_PYTHON=/tmp/tt-venv/bin/python .venv/bin/pytest tests/test_torchtitan.py
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 VENV_DIR" >&2; exit 2; }
venv="$1"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${PYTHON:-python3.11}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# torch pinned first: the later installs keep it, and never pick a newer one
"${pip[@]}" torch==2.13.0
"${pip[@]}" torchft==0.2.0 torchtitan==0.3.0 triton -e "$repo[worker]"
"$venv/bin/python" -c "import torch, torchft, torchtitan, triton, worker_server; print('torch', torch.__version__, 'torchtitan', torchtitan.__version__)"
