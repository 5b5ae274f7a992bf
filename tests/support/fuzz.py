"""Seeded mutation of JSON-like documents, for the fuzz tests (tests/test_audit_fuzz_*.py)."""

from __future__ import annotations

import copy
import random
from typing import Any


def mutate(rng: random.Random, doc: Any, weird: list, delete_p: float = 0.0) -> None:
    """Replace (or, with probability ``delete_p``, delete from a dict) 1 to 3 values anywhere
    in ``doc``, in place, with copies of ``weird``'s."""
    for _ in range(rng.randint(1, 3)):
        spots, stack = [], [doc]
        while stack:
            c = stack.pop()
            for k in (list(c) if isinstance(c, dict) else range(len(c))):
                spots.append((c, k))
                if isinstance(c[k], dict | list):
                    stack.append(c[k])
        c, k = rng.choice(spots)
        if delete_p and isinstance(c, dict) and rng.random() < delete_p:
            del c[k]
        else:
            c[k] = copy.deepcopy(rng.choice(weird))
