"""The router's threat model, the fleet's size (issue 40 item 4): whoever can write the
discovery file (or reach the admin API) could make the router hold any number of engines:
a 100,000-entry file (3.97 MB, under discovery.max_file_bytes) took about 30 s and
+336 MiB to parse, with p99 latency at 560 ms meanwhile. discovery.max_engines bounds the
fleet; a file past it is refused before any entry is validated, and parsed with the C
loader (or json)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from narwhal.fleet.file import read_fleet_file
from narwhal.fleet.source import SourceError


def test_a_100000_entry_discovery_file_is_refused_in_well_under_a_second_of_parsing(tmp_path: Path) -> None:
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps([{"name": f"e{i}", "url": f"http://h{i}:1"} for i in range(100_000)], separators=(",", ":")))
    assert f.stat().st_size < 4 << 20  # under discovery.max_file_bytes' default
    t0 = time.process_time()
    got = read_fleet_file(str(f), 4 << 20, 1024)
    cpu = time.process_time() - t0
    assert isinstance(got, SourceError) and "100000 engines, over discovery.max_engines (1024)" in got.message
    assert cpu < 2.0, cpu  # before: every entry validated, about 30 s


def test_the_same_file_as_yaml_is_parsed_by_the_c_loader(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("".join(f"- {{name: e{i}, url: 'http://10.0.{i >> 8 & 255}.{i & 255}:8000'}}\n" for i in range(20_000)))
    t0 = time.process_time()
    got = read_fleet_file(str(f), 4 << 20, 1024)
    cpu = time.process_time() - t0
    assert isinstance(got, SourceError) and "over discovery.max_engines" in got.message
    assert cpu < 3.0, cpu  # the pure-Python loader alone took several seconds for this
