"""XLA's buffer dumps for a compiled module (`--xla_dump_to` with
`--xla_dump_hlo_as_text`): the live-range report (`*live-range.txt`: the values live at
each point of the schedule, the peak marked) and the buffer assignment
(`*buffer-assignment.txt`: each allocation and the values that lie in it, at an offset).
Values are named by instruction and tuple index, as in the optimized module XLA dumped
next to them.
"""

from __future__ import annotations

import re

_PEAK_HEADER = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_PEAK_LINE = re.compile(r"^\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_ALLOCATION_LINE = re.compile(r"^allocation (\d+): ")
_VALUE_LINE = re.compile(
    r"^\s*value: <\d+ ([\w.\-]+)(?:\{([\d,]*)\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")


def read_peak(live_range_text: str) -> list[tuple[str, str, int]]:
    """(instruction, tuple index, bytes) of every value live at the peak."""
    out, inside = [], False
    for line in live_range_text.splitlines():
        if _PEAK_HEADER.match(line):
            inside = True
            continue
        if inside:
            m = _PEAK_LINE.match(line)
            if not m:
                break
            out.append((m.group(1), m.group(2), int(m.group(3))))
    return out


def buffer_slices(buffer_assignment_text: str) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(instruction, tuple index) of every value in XLA's buffer assignment -> (allocation,
    offset, bytes): where it lies. Values that share a slice (a loop's carry and what its
    body writes in place, a conditional's output and its branches') are one buffer."""
    out, allocation = {}, -1
    for line in buffer_assignment_text.splitlines():
        if m := _ALLOCATION_LINE.match(line):
            allocation = int(m.group(1))
        elif m := _VALUE_LINE.match(line):
            out.setdefault((m.group(1), m.group(2) or ""),
                           (allocation, int(m.group(4)), int(m.group(3))))
    return out
