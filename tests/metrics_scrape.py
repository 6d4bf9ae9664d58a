"""Scraping a daemon's Prometheus metrics over real HTTP, for the tests of several tiers."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape, by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(address: str) -> tuple[Samples, set[str]]:
    """GET http://ADDRESS/metrics: its samples and the families' types ("name type")."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    kinds = {f"{f.name} {f.type}" for f in text_string_to_metric_families(text)}
    return parse(text), kinds


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def metrics_address(daemon: Any) -> str:
    """The address a `commd run` subprocess serves metrics on: its READY status line says."""
    for note in daemon.notifications:
        match = re.search(r"metrics on (\S+:\d+)", note)
        if match:
            return match.group(1).rstrip(",")
    raise AssertionError(f"no metrics address in {daemon.notifications}")
