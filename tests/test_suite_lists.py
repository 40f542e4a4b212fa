"""The mutants' list (tests/mutants.py) against the code as it is: every planted line
occurs exactly once in its file, and every killing test exists. A code change that moves
a mutated line fails here, in seconds, not in the mutants' run after the suite."""

from __future__ import annotations

import os
import re

import pytest

from conftest import ROOT
from mutants import MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_plants_one_line_and_names_real_tests(mutant):
    text = open(os.path.join(ROOT, mutant.path)).read()
    assert text.count(mutant.old) == 1, (
        f"{mutant.path} holds {text.count(mutant.old)} copies of {mutant.old!r}: update the "
        f"mutant {mutant.name} in tests/mutants.py")
    for node in mutant.tests:
        path, name = node.split("::")
        name = re.sub(r"\[.*\]$", "", name)
        source = open(os.path.join(ROOT, path)).read()
        assert re.search(rf"^def {name}\(", source, re.M), (mutant.name, node)
