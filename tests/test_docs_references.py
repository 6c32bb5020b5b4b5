"""Every measurement file the docs name exists: a number in README.md or docs/ can be traced to a committed
file under benchmarks/results/ (and an experiment's patch or script to docs/experiments/)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(r"`(?:benchmarks/results/)?((?:h100|h200|sm90|cpu|check)_[\w.\-]+\.(?:json|jsonl|txt))`")
EXPERIMENT = re.compile(r"`(?:git apply )?(docs/experiments/[\w.\-]+\.(?:patch|py))")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_results_file_the_docs_name_is_committed():
    named = {(doc.name, m.group(1)) for doc in _docs() for m in RESULT.finditer(doc.read_text())}
    assert len(named) > 20  # the docs do cite their numbers' files
    missing = [(doc, name) for doc, name in sorted(named) if not (ROOT / "benchmarks" / "results" / name).is_file()]
    assert not missing, missing


def test_every_experiment_the_docs_name_is_committed():
    named = {m.group(1) for doc in _docs() for m in EXPERIMENT.finditer(doc.read_text())}
    assert named and all((ROOT / path).is_file() for path in named), named
