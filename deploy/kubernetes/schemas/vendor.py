#!/usr/bin/env python3
"""Cut the JSON schemas the tests check custom resources against out of upstream CRD files.

    python deploy/kubernetes/schemas/vendor.py CRD.yaml... [--out deploy/kubernetes/schemas]

Run by hand on CRD files from an upstream checkout (NOTICE names the releases); the project
never downloads anything. For each CRD it keeps the served version's ``openAPIV3Schema``
without its ``description`` texts (most of the size), and for LeaderWorkerSet it replaces the
embedded pod templates (``leaderTemplate``, ``workerTemplate``) and ``volumeClaimTemplates``
with an open object: the tests check those against Kubernetes' own schemas (kubernetes-validate)
instead. Needs PyYAML. A file that is not a CRD stops it with a message naming the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OPEN_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
# LeaderWorkerSet's embedded Kubernetes templates, checked with kubernetes-validate instead
LWS_OPEN = {"leaderTemplate", "workerTemplate", "volumeClaimTemplates"}


def strip(schema, *, open_props: frozenset[str] = frozenset()):
    """``schema`` without description keywords; properties named in ``open_props`` opened."""
    if isinstance(schema, list):
        return [strip(s, open_props=open_props) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: (OPEN_OBJECT if name in open_props
                               else strip(sub, open_props=open_props))
                        for name, sub in value.items()}
        else:
            out[key] = strip(value, open_props=open_props)
    return out


def cut(crd: dict, source: str) -> tuple[str, dict]:
    """(file name, schema) for one CRD document."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise SystemExit(f"vendor.py: {source}: not a CustomResourceDefinition")
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("storage"))
    schema = version["schema"]["openAPIV3Schema"]
    open_props = frozenset(LWS_OPEN if spec["names"]["kind"] == "LeaderWorkerSet" else ())
    name = f"{spec['group']}_{version['name']}_{spec['names']['kind'].lower()}.json"
    return name, strip(schema, open_props=open_props)


def main(argv: list[str] | None = None) -> int:
    import yaml  # only this script needs it

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("crds", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    for path in args.crds:
        name, schema = cut(yaml.safe_load(path.read_text()), str(path))
        (args.out / name).write_text(json.dumps(schema, sort_keys=True, indent=1) + "\n")
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
