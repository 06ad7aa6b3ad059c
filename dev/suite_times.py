"""Probe: where the test suite's time goes, per file, from a run's JUnit XML (pytest's
``--junitxml``; each case's time is its setup, call and teardown), with the file sums that two
workers taking whole files split between them.

    PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml bash .ci/run
    python dev/suite_times.py /tmp/junit.xml [--files 30] [--tests 20]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def file_of(classname: str) -> str:
    """``tests.s3.test_x`` or ``tests.s3.test_x.TestY`` -> ``tests/s3/test_x.py``."""
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit")
    parser.add_argument("--files", type=int, default=30)
    parser.add_argument("--tests", type=int, default=20)
    args = parser.parse_args()
    sums: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    cases: list[tuple[float, str]] = []
    for case in ET.parse(args.junit).getroot().iter("testcase"):
        name, seconds = file_of(case.get("classname", "")), float(case.get("time", 0))
        sums[name] += seconds
        counts[name] += 1
        cases.append((seconds, f"{name}::{case.get('name')}"))
    total = sum(sums.values())
    print(f"{total:.0f} s in {len(cases)} cases of {len(sums)} files "
          f"(half: {total / 2:.0f} s)\n\n| file | cases | s | share |\n|---|---:|---:|---:|")
    for name, seconds in sums.most_common(args.files):
        print(f"| {name} | {counts[name]} | {seconds:.0f} | {100 * seconds / total:.1f} % |")
    print("\n| case | s |\n|---|---:|")
    for seconds, name in sorted(cases, reverse=True)[:args.tests]:
        print(f"| {name} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
