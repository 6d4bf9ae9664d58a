"""Model profiles: the per-layer gradient sizes and backward times that planners need.

A profile is JSON ``{"name": str, "forward_s": float, "layers": [{"name": str, "bytes": int,
"backward_s": float}, ...]}`` with layers in forward order; other keys are ignored. Shipped
profiles live in the package as ``commd/plan/profiles/NAME.json`` (data only, not a package).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

__all__ = [
    "Profile",
    "load_profile",
    "parse_profile",
    "resolve_profile",
    "shipped_profile_names",
]


@dataclass(frozen=True)
class Profile:
    """One model's layers in forward order: gradient bytes and backward seconds of each."""

    name: str
    forward_s: float
    layer_names: tuple[str, ...]
    sizes_bytes: tuple[int, ...]
    backward_s: tuple[float, ...]

    @property
    def single_node_s(self) -> float:
        """One node never communicates: an iteration is forward plus backward."""
        return self.forward_s + sum(self.backward_s)


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"{where} must be >= 0, got {value!r}")
    return float(value)


def parse_profile(data: object, source: str = "profile") -> Profile:
    """Check decoded JSON ``{"name", "forward_s", "layers": [{"name", "bytes", "backward_s"}]}``.

    Other keys (e.g. "source") are ignored. ValueError names the bad field.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}: 'name' must be a non-empty string")
    forward_s = _number(data.get("forward_s"), f"{source}: 'forward_s'")
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{source}: 'layers' must be a non-empty list")
    names: list[str] = []
    sizes: list[int] = []
    times: list[float] = []
    for k, layer in enumerate(layers):
        where = f"{source}: layers[{k}]"
        if not isinstance(layer, dict):
            raise ValueError(f"{where} must be an object with name, bytes and backward_s")
        layer_name = layer.get("name", f"layer{k}")
        if not isinstance(layer_name, str):
            raise ValueError(f"{where}.name must be a string, got {layer_name!r}")
        nbytes = layer.get("bytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{where}.bytes must be an integer >= 0, got {nbytes!r}")
        names.append(layer_name)
        sizes.append(nbytes)
        times.append(_number(layer.get("backward_s"), f"{where}.backward_s"))
    return Profile(name, forward_s, tuple(names), tuple(sizes), tuple(times))


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file; ValueError (never OSError) says what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read profile {str(path)!r}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not valid JSON: {exc}") from None
    return parse_profile(data, str(path))


def _shipped_dir() -> Traversable | None:
    """commd/plan/profiles/ inside the installed package (may be absent)."""
    try:
        return resources.files("commd.plan") / "profiles"
    except (ModuleNotFoundError, OSError, TypeError):
        return None


def shipped_profile_names() -> list[str]:
    """Names of the profiles shipped in commd/plan/profiles/*.json (none is fine)."""
    folder = _shipped_dir()
    try:
        if folder is None or not folder.is_dir():
            return []
        return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))
    except OSError:
        return []


def resolve_profile(spec: str) -> Profile:
    """``spec`` is a file, or else the name of a shipped profile (commd/plan/profiles/NAME.json)."""
    if Path(spec).exists() or "/" in spec or spec.endswith(".json"):
        return load_profile(spec)
    folder = _shipped_dir()
    candidate = folder / f"{spec}.json" if folder is not None else None
    if candidate is not None and candidate.is_file():
        try:
            data = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"shipped profile {spec!r} cannot be read: {exc}") from None
        return parse_profile(data, f"shipped profile {spec!r}")
    shipped = ", ".join(shipped_profile_names()) or "none"
    raise ValueError(
        f"no profile file {spec!r} and no shipped profile of that name (shipped: {shipped})"
    )
