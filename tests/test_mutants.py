"""scripts/mutate.py's table follows the code: each mutant's snippet occurs exactly once
in its file (else the script stops, and docs/mutation.md goes stale unnoticed)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).parent.parent


def test_every_mutant_snippet_occurs_once():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutate", mutate)  # its dataclasses look their module up
    spec.loader.exec_module(mutate)
    counts = {m.name: (ROOT / m.file).read_text().count(m.old) for m in mutate.MUTANTS}
    assert {name: n for name, n in counts.items() if n != 1} == {}
