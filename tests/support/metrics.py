"""A `gym-rpc head`'s Prometheus endpoints: the URLs its banner announces, and its samples scraped and read."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.cli import HeadProcess
from tests.support.loopback import LOOPBACK
from tests.support.waiting import eventually_blocking

HTTP_HEAD_PATTERN = re.compile(r"NeMo Gym HTTP head on (http://\S+?)[;\s]")

WAIT_SECONDS = 15.0


METRICS_PATTERN = re.compile(r"metrics on (http://\S+/metrics)")


def write_config(path: Path, servers: dict[str, object], **head: object) -> Path:
    doc = {"head_server": {"host": LOOPBACK, "port": 0, **head}, **servers}
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def announced(head: HeadProcess, pattern: re.Pattern[str]) -> str:
    """A URL the head's banner line announced."""
    match = pattern.search(head.banner + " ")
    assert match, head.banner
    return match.group(1)


def scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The one sample `name` whose labels include `labels`, None when there is none."""
    found = [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, found
    return found[0].value if found else None


def scrape_until(url: str, check: Callable[[list[Sample]], bool], what: str) -> list[Sample]:
    """The samples of the first scrape `check` takes (every 0.1 s, within WAIT_SECONDS)."""
    return eventually_blocking(
        lambda: scrape(url), check, within=WAIT_SECONDS, what=f"/metrics showing {what}", every=0.1
    )
