"""Errors that tell the user what went wrong, what was found, what was expected and how to fix it.

Every verb catches `DraftsmithError` at the CLI boundary, prints it and exits with code 2
(bad usage or bad input, see docs/design.md "Pipeline and verbs").
"""

from __future__ import annotations


class DraftsmithError(Exception):
    """A user-facing error: what happened, what was found, what was expected, and the fix.

    Args:
        what: one line naming the problem ("malformed JSONL line").
        got: what was found.
        expected: what should have been there.
        fix: the concrete action that resolves it.
    """

    def __init__(self, what: str, *, got: str = "", expected: str = "", fix: str = ""):
        self.what, self.got, self.expected, self.fix = what, got, expected, fix
        super().__init__(self.render())

    def render(self) -> str:
        lines = [self.what]
        if self.got:
            lines.append(f"  got:      {self.got}")
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.fix:
            lines.append(f"  fix:      {self.fix}")
        return "\n".join(lines)
