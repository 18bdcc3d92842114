"""Hand-written notes on a generated benchmark page: kept between two markers, carried over
when the page is written again."""

from __future__ import annotations

from pathlib import Path

NOTES_START, NOTES_END = "<!-- notes -->", "<!-- /notes -->"


def existing_notes(path: Path) -> str:
    """The notes between the markers of the page at `path`, or "" if there are none."""
    if not path.exists():
        return ""
    text = path.read_text()
    if NOTES_START in text and NOTES_END in text:
        return text.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0]
    return ""
