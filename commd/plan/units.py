"""Parsing of sizes, durations and bandwidths written by people ("25MB", "50us", "10Gbps"),
and durations written for people."""

from __future__ import annotations

import math
import re

__all__ = ["format_seconds", "parse_bandwidth", "parse_duration", "parse_nodes", "parse_size"]

_MAX_NODES = 1 << 20

# Byte sizes: decimal (KB = 1000) and binary (KiB = 1024) units, case-insensitive.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# Durations; a bare number is seconds.
# Divisors rather than factors: 50 / 1e6 rounds to exactly 5e-05, 50 * 1e-6 does not.
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
# Bandwidth prefixes; "b" is bits and "B" bytes ("Gbps", "Gb/s" are bits; "GB/s" bytes).
_RATE_PREFIXES = {
    "": 1.0,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2.0**10,
    "mi": 2.0**20,
    "gi": 2.0**30,
}
_BANDWIDTH_UNITS_HELP = "bps, Kbps, Mbps, Gbps, Gb/s (bits); MB/s, GB/s, GiB/s (bytes)"

_NUMBER_AND_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9.].*?)?\s*")


def _split(
    text: str, what: str, units: dict[str, float] | dict[str, int], help_: str
) -> tuple[float, str]:
    match = _NUMBER_AND_UNIT.fullmatch(text)
    unit = (match.group(2) or "") if match else ""
    # Size and time units are case-insensitive: "mb" can only mean megabytes here.
    if match is None or unit.lower() not in units:
        raise ValueError(f"cannot read {what} {text!r}: expected a number with a unit ({help_})")
    return float(match.group(1)), unit.lower()


def parse_size(text: str) -> int:
    """ "25MB" -> 25_000_000, "128MiB" -> 134_217_728, "1048576" -> 1_048_576 (bytes, > 0)."""
    value, unit = _split(text, "size", _SIZE_UNITS, "B, KB, MB, GB, KiB, MiB, GiB")
    nbytes = round(value * _SIZE_UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"size {text!r} must be at least one byte")
    return nbytes


def parse_duration(text: str) -> float:
    """ "50us" -> 5e-05, "1.5ms" -> 0.0015, "2" -> 2.0 (seconds, >= 0)."""
    value, unit = _split(text, "duration", _TIME_UNITS, "s, ms, us, ns")
    seconds = value / _TIME_UNITS[unit]
    if not math.isfinite(seconds):
        raise ValueError(f"duration {text!r} is not finite")
    return seconds


def parse_bandwidth(text: str) -> float:
    """ "10Gbps" -> 1.25e9 bytes/s; "9GiB/s" -> 9·2**30 bytes/s; a bare number is bits/s."""
    match = _NUMBER_AND_UNIT.fullmatch(text)
    unit = (match.group(2) or "") if match else ""
    per_byte: float | None = None  # how many bytes one unit of the number is
    if unit == "":
        per_byte = 1 / 8  # networks are sold in bits per second
    elif unit.lower().endswith("bps") and unit[:-3].lower() in _RATE_PREFIXES:
        per_byte = _RATE_PREFIXES[unit[:-3].lower()] / 8
    elif unit.endswith(("B/s", "b/s")) and unit[:-3].lower() in _RATE_PREFIXES:
        per_byte = _RATE_PREFIXES[unit[:-3].lower()] / (1 if unit[-3] == "B" else 8)
    if match is None or per_byte is None:
        raise ValueError(
            f"cannot read bandwidth {text!r}: expected a number with a unit "
            f"({_BANDWIDTH_UNITS_HELP})"
        )
    rate = float(match.group(1)) * per_byte
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"bandwidth {text!r} must be > 0")
    return rate


def parse_nodes(text: str) -> list[int]:
    """ "8" -> [8]; "2,4,8" -> [2, 4, 8]; "2..1024" -> [2, 4, ..., 1024] (A, 2A, 4A, ... <= B)."""

    def count(part: str) -> int:
        try:
            value = int(part.strip())
        except ValueError:
            raise ValueError(f"cannot read node count {part.strip()!r} in --nodes") from None
        if not 1 <= value <= _MAX_NODES:
            raise ValueError(f"node count {value} in --nodes must be 1..{_MAX_NODES}")
        return value

    counts: set[int] = set()
    for part in text.split(","):
        if ".." in part:
            low, high = (count(x) for x in part.split("..", 1))
            if low > high:
                raise ValueError(f"node range {part.strip()!r} runs backwards")
            while low <= high:
                counts.add(low)
                low *= 2
        else:
            counts.add(count(part))
    return sorted(counts)


def format_seconds(value: float, micro: str = "us") -> str:
    """``value`` seconds in s, ms or ``micro``-seconds, whichever reads best."""
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.1f} {micro}"
