"""bench/checkpoint.py's write_doc replaces only its own block of its own section."""

from __future__ import annotations

from pathlib import Path

from bench import checkpoint

DOC = """# Benchmarks

## Ingest (bench/ingest.py)

ingest table

## Checkpoint (bench/checkpoint.py)

### `.venv/bin/python bench/checkpoint.py`

old full

### `BENCH_QUICK=1 .venv/bin/python bench/checkpoint.py`

old quick

## API fuzzing (tests/security/test_fuzz.py)

### 2026-12-01, 2 CPUs

fuzz table
"""


def test_write_doc_keeps_the_other_block_and_sections(tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    monkeypatch.setattr(checkpoint, "QUICK", False)
    checkpoint.write_doc("new full", doc)
    text = doc.read_text()
    assert "new full" in text
    assert "old full" not in text
    assert "old quick" in text
    assert text.index("## Checkpoint") < text.index("new full") < text.index("## API fuzzing")
    assert "### 2026-12-01, 2 CPUs\n\nfuzz table" in text
    assert text.startswith("# Benchmarks\n\n## Ingest (bench/ingest.py)\n\ningest table")
    monkeypatch.setattr(checkpoint, "QUICK", True)
    checkpoint.write_doc("new quick", doc)
    text = doc.read_text()
    assert "old quick" not in text
    assert "new quick" in text
    assert "new full" in text
    assert text.count("## API fuzzing") == 1
    assert text.count("## Checkpoint") == 1


def test_write_doc_appends_a_missing_section(tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Ingest (bench/ingest.py)\n\nx\n")
    monkeypatch.setattr(checkpoint, "QUICK", False)
    checkpoint.write_doc("full", doc)
    text = doc.read_text()
    assert text.index("## Ingest") < text.index("## Checkpoint (bench/checkpoint.py)")
    assert text.rstrip().endswith("full")
