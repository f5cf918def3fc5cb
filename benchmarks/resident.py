"""This process's resident memory on Linux, for the CPU memory figures of the benchmarks.

A benchmark measures a step's peak as the resident set's high-water mark (``VmHWM``) after
`reset_peak_rss` minus the resident set (``VmRSS``) before the step, in a fresh process whose glibc
returns large allocations to the system on free (``MALLOC_MMAP_THRESHOLD_``, set by the parent), so that
the resident set is the live memory.
"""

from __future__ import annotations


def status_kib(field: str) -> int:
    """The value of ``field`` (``VmRSS``, ``VmHWM``) in ``/proc/self/status``, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset the resident set's high-water mark (``VmHWM``) to the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
