"""Packed ``timing.recent`` bytes read back as rows, for the tests (the monitor folds the bytes
whole: monitor.detect.step_memory)."""

from __future__ import annotations

from rank_wire import TIMING_ROW, valid_row


def unpack_rows(blob: bytes) -> list[tuple[int, tuple[float, ...]]]:
    """The valid rows of packed ``timing.recent`` bytes: (step, its four seconds), in order; a
    trailing partial record is ignored."""
    whole = blob[:len(blob) - len(blob) % TIMING_ROW.size]
    return [(step, tuple(secs)) for step, *secs in TIMING_ROW.iter_unpack(whole)
            if valid_row(step, secs)]
