"""One benchmark's section of docs/benchmarks.md, replaced in place (the other sections
stay)."""

from __future__ import annotations

from pathlib import Path


def replace_section(doc: Path, head: str, command: str, block: str) -> None:
    """Write ``head`` (a ``## `` heading), the ``### `command` `` line and ``block`` into
    ``doc``, in place of the section under ``head`` (appended when there is none).

    Args:
        doc: docs/benchmarks.md.
        head: The section's heading line, e.g. ``## S3 upload (bench/s3_upload.py)``.
        command: The command the block measured, e.g. ``.venv/bin/python bench/x.py``.
        block: The section's body (markdown).
    """
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    before, found, after = text.partition(head)
    rest = ""
    if found:
        nxt = after.find("\n## ")
        rest = after[nxt:] if nxt >= 0 else ""
    doc.write_text(
        before.rstrip()
        + "\n\n"
        + head
        + "\n\n"
        + f"### `{command}`"
        + "\n\n"
        + block
        + "\n"
        + rest.rstrip("\n")
        + ("\n" if rest else "")
    )
