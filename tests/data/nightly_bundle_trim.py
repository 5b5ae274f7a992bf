"""An incident bundle made small enough to keep in tests/data: its Flight Recorder dumps cut to
each rank's newest entries, its stacks left out (``lightkeeper analyze`` reads no stacks).

    .venv/bin/python tests/data/nightly_bundle_trim.py BUNDLE.tar.gz OUT.tar.gz [ENTRIES]
"""

from __future__ import annotations

import io
import json
import sys
import tarfile


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    keep = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz") as tout:
        for m in tin.getmembers():
            if not m.isfile() or "/stacks/" in m.name:
                continue
            data = tin.extractfile(m).read()
            if "/fr/" in m.name:
                doc = json.loads(data)
                doc["entries"] = doc["entries"][-keep:]
                data = json.dumps(doc, separators=(",", ":")).encode()
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime, info.mode = len(data), m.mtime, 0o644
            tout.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
