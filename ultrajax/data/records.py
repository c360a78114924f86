"""One JSONL line -> its document's text, or why it is left out: the checks that
`prepare` and `data.source=files` share, so a prepared corpus and the files it was made
from hold the same documents and report the same lines.

A line is left out, and counted as a problem, when it is not valid JSON, not a JSON
object, or has no string "text". Invalid UTF-8 and escaped lone surrogates are problems
too, but the line is kept with the bad characters replaced (as a text file is read).
Blank lines and empty texts are left out without a problem. No JAX: `prepare`'s workers
import this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """What is wrong: `kind` is counted, `reason` printed after file:line; `line` counts
    from 1 inside the bytes checked (a whole text file: the line of the first bad byte)."""

    kind: str
    reason: str
    line: int = 1


@dataclass
class Record:
    """What a line holds: its text (None: left out), its problems, and why a line without
    problems was left out ('blank line', 'empty text')."""

    text: str | None
    problems: list[Problem] = field(default_factory=list)
    skipped: str | None = None


def json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def decode(raw: bytes) -> tuple[str, Problem | None]:
    """UTF-8 with replacement (U+FFFD, as Doc.read decodes a file), and the first invalid
    byte as a problem at its line and column."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        reason = (
            f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte column {column}), replaced by U+FFFD"
        )
        return raw.decode("utf-8", errors="replace"), Problem("invalid UTF-8", reason, line)


def read_line(raw: bytes) -> Record:
    """One JSONL line (its newline included or not) -> its text and problems."""
    if not raw.strip():
        return Record(None, skipped="blank line")
    text, bad = decode(raw)
    problems = [bad] if bad else []
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        problems.append(Problem("invalid JSON", f"invalid JSON ({e.msg}, column {e.colno})"))
        return Record(None, problems)
    if not isinstance(record, dict):
        reason = f"a JSON {json_type(record)}, not an object"
        return Record(None, [*problems, Problem("not an object", reason)])
    value = record.get("text")
    if not isinstance(value, str):
        what = "missing" if "text" not in record else f"a JSON {json_type(value)}"
        return Record(None, [*problems, Problem("no text", f'"text" is {what}, not a string')])
    if "\\u" in text:  # an escaped lone surrogate cannot be encoded: replace it
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            reason = f"a lone surrogate \\u{ord(value[e.start]):04x} in the text, replaced by '?'"
            problems.append(Problem("lone surrogate", reason))
            value = value.encode("utf-8", errors="replace").decode("utf-8")
    if not value:
        return Record(None, problems, skipped="empty text")
    return Record(value, problems)


def describe(kinds: Mapping[str, int], first: list[str], shown: int, note: str = "") -> str:
    """'3 problems (2 invalid JSON, 1 no text)<note>; the first 2:' and one indented
    'file:line: reason' line each (just ':' when every problem is listed)."""
    count = sum(kinds.values())
    listed = first[:shown]
    counts = ", ".join(f"{n:,} {kind}" for kind, n in sorted(kinds.items()))
    head = f"{count:,} problem{'s' * (count != 1)} ({counts}){note}"
    head += ":" if len(listed) == count else f"; the first {len(listed)}:"
    return "\n".join([head, *(f"  {p}" for p in listed)])
