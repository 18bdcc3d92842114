"""Pythonic calls: a Python list of calls with keyword arguments, `[f(a=1, b="x"), g()]`.

Synopsis::

    parser = PythonicParser([ToolSpec("get_weather")])
    parser.parse('[get_weather(city="Paris", days=[1, 2])]')
    # (None, [ParsedCall(name='get_weather', arguments='{"city": "Paris", "days": [1, 2]}')])

What is accepted, as SGLang's `PythonicDetector` does
(python/sglang/srt/function_call/pythonic_detector.py): the output, stripped, starts with a
list of calls, parsed with Python's `ast`; names may be dotted (`a.b`); argument values must be
literals (strings, numbers, `True`/`False`/`None`, and lists, tuples and dicts of them; tuples
become JSON arrays).

Where this differs from SGLang: SGLang wants the whole output to be the list; here text after
the list is content. A list that is not calls, a call with positional or `**` arguments, or a
value that is not a literal keeps the whole list as content (SGLang ignores positional
arguments; here a call is never made with arguments missing).
"""

from __future__ import annotations

import ast
import re

from .base import CallChecker, ParsedCall, Rejected, ScannedParser, Scanner, Settled, skip_blanks

__all__ = ["PythonicParser"]

#: The start of a call list: `[`, then a (dotted) name and `(`.
_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
#: Text that may still grow into `_START`.
_START_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = _call_name(func.value)
        return None if owner is None else f"{owner}.{func.attr}"
    return None


def _expression(source: str) -> ast.expr | None:
    """The Python expression `source` is, or None when it is not one."""
    try:
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class _ListEnd:
    """Finds the `]` that closes the list opened at `start`, minding Python's brackets and
    string literals. It resumes where it stopped: each text offered must extend the one
    offered before, so a streamed call list is read once, not once per piece."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._quote = ""  # the open string literal's quote: ', ", \'\'\' or \"\"\"
        self._escaped = False

    def find(self, text: str) -> int:
        """Where the closing `]` is, or -1 when it has not come yet."""
        i, size = self._pos, len(text)
        while i < size:
            c = text[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote[0]:
                    if len(self._quote) == 1:
                        self._quote = ""
                    elif size - i < 3:
                        break  # the end of the string, or a quote inside it: not known yet
                    elif text.startswith(self._quote, i):
                        self._quote = ""
                        i += 2
            elif c in "'\"":
                if text[i:] == c * (size - i) and size - i < 3:
                    break  # an empty string, or a triple quote: not known yet
                self._quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self._quote) - 1
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i
                    return i
            i += 1
        self._pos = i
        return -1


class _PythonicScanner(Scanner):
    def __init__(self, checker: CallChecker) -> None:
        self._checker = checker
        self._content_only = False
        self._list_end: _ListEnd | None = None

    def scan(self, text: str, *, final: bool) -> Settled:
        if self._content_only:
            return ([text] if text else []), len(text)
        first = skip_blanks(text, 0)
        if not final and (first == len(text) or _START_PREFIX.fullmatch(text, first)):
            return [], 0
        if not _START.match(text, first):
            self._content_only = True
            return ([text] if text else []), len(text)
        if self._list_end is None:
            self._list_end = _ListEnd(first)
        close = self._list_end.find(text)
        if close == -1:
            if not final:
                return [], 0
            self._content_only = True
            return [text], len(text)
        self._content_only = True
        expression = _expression(text[first : close + 1])
        accepted = None if expression is None else self._accept(expression)
        pieces: list[str | ParsedCall] = [text[: close + 1]] if accepted is None else [*accepted]
        if close + 1 < len(text):
            pieces.append(text[close + 1 :])
        return pieces, len(text)

    def _accept(self, expression: ast.expr) -> list[ParsedCall] | None:
        """The accepted calls of a list of calls, or None when it is not one."""
        if not isinstance(expression, ast.List):
            return None
        accepted: list[ParsedCall] = []
        for call in expression.elts:
            if not isinstance(call, ast.Call):
                return None
            name = _call_name(call.func)
            if name is None or call.args or any(k.arg is None for k in call.keywords):
                return None
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            outcome = self._checker.check(name, arguments)
            if outcome is Rejected.MALFORMED:
                return None
            if isinstance(outcome, ParsedCall):
                accepted.append(outcome)
        return accepted


class PythonicParser(ScannedParser):
    """`pythonic`: a Python list of calls at the start of the output."""

    def new_scanner(self) -> Scanner:
        return _PythonicScanner(self.checker)
