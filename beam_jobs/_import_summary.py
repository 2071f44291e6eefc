"""The import's summary: the shards' reports combined, written as JSON."""

from __future__ import annotations

import json
import os

import apache_beam as beam

from beam_jobs._columns import ColumnSpec


class SummaryFn(beam.CombineFn):
    """Shard reports -> one: counts summed, files listed, distinct values merged.

    A report is `{"lines", "records", "dead_letters": int, "files": [{"path",
    "records"}], "distinct": [set of values per column]}`; so is the output.
    """

    def create_accumulator(self):
        return {"lines": 0, "records": 0, "dead_letters": 0, "files": [], "distinct": None}

    def add_input(self, accumulator, report):
        for key in ("lines", "records", "dead_letters"):
            accumulator[key] += report[key]
        accumulator["files"].extend(report["files"])
        if accumulator["distinct"] is None:
            accumulator["distinct"] = [set() for _ in report["distinct"]]
        for seen, more in zip(accumulator["distinct"], report["distinct"], strict=True):
            seen |= more
        return accumulator

    def merge_accumulators(self, accumulators):
        merged = self.create_accumulator()
        for accumulator in accumulators:
            if accumulator["distinct"] is not None:
                merged = self.add_input(merged, accumulator)
        return merged

    def extract_output(self, accumulator):
        return accumulator


def write_summary(report: dict, path: str, spec: ColumnSpec, inputs: list[str], fmt: str):
    """Writes `import_summary.json` (via a renamed temporary file).

    Its fields: `inputs`, `lines`, `records`, `dead_letters`,
    `output_format`, `files` (`{"path", "records"}` in record order), and
    `columns`: per column its `name`, `kind`, Example `key` and number of
    `distinct_values`.
    """
    summary = {
        "inputs": inputs,
        "lines": report["lines"],
        "records": report["records"],
        "dead_letters": report["dead_letters"],
        "output_format": fmt,
        "files": sorted(report["files"], key=lambda f: f["path"]),
        "columns": [
            {
                "name": column.name,
                "kind": column.kind.value,
                "key": spec.feature_key(column),
                "distinct_values": len(seen),
            }
            for column, seen in zip(spec.columns, report["distinct"], strict=True)
        ],
    }
    temp = f"{path}.tmp"
    with open(temp, "w") as file:
        json.dump(summary, file, indent=1)
    os.replace(temp, path)
