"""The suite's own lists against the suite as pytest collects it, in seconds:

- the tiers (tests/README.md, "Tiers"): every test marked ``extended`` is listed under a
  capability, every listed test exists and is in the tier its column says, and every
  capability keeps a fast test - so a test moved into or out of the extended tier
  without the list changing fails here;
- the mutants (tests/mutants.py): every planted line occurs once in its file, every
  killing test is a node id pytest collects (parameter ids included), every PPO reference
  case a killing test names is one the mutant traces, and the fast subset's killing tests
  run in the fast tier."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from mutants import MUTANTS, REF


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, bool]:
    """Every test pytest collects in tests/ -> whether it is in the extended tier."""
    path = tmp_path_factory.mktemp("collect") / "collected.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "-n", "0", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items()
                                  if k != "MEGARLHF_OUTCOMES"},  # the suite's, not ours
                               "MEGARLHF_COLLECTED": str(path), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    items = json.loads(path.read_text())
    assert len(items) > 500, len(items)  # the whole suite, not a corner of it
    return items


def covers(entry: str, node: str) -> bool:
    """A listed entry names a test file, a test function (all its parameters) or one
    parametrised test; ``*`` stands for any characters (a family's tests in a file:
    ``tests/test_convert.py::*mixtral*``)."""
    if "*" in entry:
        return re.fullmatch(".*".join(map(re.escape, entry.split("*"))), node) is not None
    return node == entry or node.startswith(entry + "::") or node.startswith(entry + "[")


def tiers_table() -> list[tuple[str, list[str], list[str]]]:
    """tests/README.md's "Tiers" table: (capability, fast tests, extended tests)."""
    text = open(os.path.join(ROOT, "tests", "README.md")).read()
    section = text.split("\n## Tiers\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("capability", "") or set(cells[0]) <= {"-"}:
            continue
        ids = [re.findall(r"`([^`]+)`", c) for c in cells[1:]]
        rows.append((cells[0], ids[0], ids[1]))
    assert len(rows) >= 10, "the Tiers table of tests/README.md is missing or cut short"
    return rows


def test_every_extended_test_is_listed_and_every_capability_keeps_a_fast_test(collected):
    rows = tiers_table()
    listed_extended = [e for _, _, ext in rows for e in ext]
    problems = []
    for capability, fast, extended in rows:
        if not fast:
            problems.append(f"{capability}: no fast test")
        for entry in fast:
            hits = [n for n in collected if covers(entry, n)]
            if not hits:
                problems.append(f"{capability}: fast test {entry} does not exist")
            elif any(collected[n] for n in hits):
                problems.append(f"{capability}: fast test {entry} is marked extended")
        for entry in extended:
            hits = [n for n in collected if covers(entry, n)]
            if not hits:
                problems.append(f"{capability}: extended test {entry} does not exist")
            elif not all(collected[n] for n in hits):
                problems.append(f"{capability}: {entry} is listed as extended but is not "
                                "marked so (or not all of it)")
    for node, extended in collected.items():
        if extended and not any(covers(e, node) for e in listed_extended):
            problems.append(f"{node} is marked extended but tests/README.md's Tiers table "
                            "does not list it")
    assert not problems, "\n".join(problems)


def test_the_tiers_check_catches_a_moved_test(collected):
    """The check above, on a suite where one fast test became extended and one extended
    test became fast: both are reported."""
    fast = next(n for n, e in collected.items() if not e and "test_suite_lists" not in n)
    ext = next(n for n, e in collected.items() if e)
    moved = {**collected, fast: True, ext: False}
    with pytest.raises(AssertionError) as err:
        test_every_extended_test_is_listed_and_every_capability_keeps_a_fast_test(moved)
    assert f"{fast} is marked extended" in str(err.value)
    assert "is listed as extended but is not marked so" in str(err.value)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_plants_one_line_and_names_real_tests(collected, mutant):
    text = open(os.path.join(ROOT, mutant.path)).read()
    assert text.count(mutant.old) == 1, (
        f"{mutant.path} holds {text.count(mutant.old)} copies of {mutant.old!r}: update the "
        f"mutant {mutant.name} in tests/mutants.py")
    assert mutant.tests, mutant.name
    for node in mutant.tests:
        assert node in collected, f"{mutant.name}: pytest collects no test {node}"
        if mutant.fast:
            assert not collected[node], (
                f"{mutant.name} is in the fast subset but {node} is in the extended tier")
        if node.startswith(REF + "::"):
            case = re.search(r"\[(.*)\]$", node).group(1)
            assert case in mutant.cases, (
                f"{mutant.name}: {node} needs the traced case {case}, which the mutant "
                f"does not trace (its cases: {mutant.cases})")
