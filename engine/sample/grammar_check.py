"""Checks on a constraint before and after it compiles: how often a regex or grammar text
repeats one part (`repetition`: bounded repetition is unrolled by the compiler), and whether a
compiled grammar has any finite output (`productive_root`: its root derives a finite string).

A rule that refers only to itself (`root ::= root`, `root ::= "a" root`, a JSON schema whose
required property is the schema itself) compiles, and its matcher allows tokens forever without
ever reaching the end: no output satisfies it. The analysis reads xgrammar's normalised EBNF
(`str(compiled.grammar)`): each line `name ::= body`, optionally followed by a lookahead
`(=(...))`, where a body is built of string literals, character classes, rule names, groups,
`|` and the quantifiers `*`, `+`, `?`, `{m, n}`, and built-ins such as `Regex("...")`, taken
as terminals. A rule is productive when one of its
alternatives is a sequence of productive items (a literal or class is; a rule name is when its
rule is; `*`, `?` and `{0, n}` always are). Anything the reader does not know makes it answer
True: it may let a bad constraint through (its request then runs to `max_tokens`), never refuse
a good one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<cls>\[(?:[^\]\\]|\\.)*\])
      | (?P<look>\(=)
      | (?P<repeat>\{\s*(?P<lo>-?\d+)\s*(?:,\s*(?P<hi>-?\d+)\s*)?\})
      | (?P<call>[A-Za-z_][A-Za-z0-9_]*\()
      | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
      | (?P<op>[()|*+?=,])
      | (?P<number>-?\d+)
    )""",
    re.VERBOSE,
)


class _Unknown(Exception):
    """A construct the reader does not know."""


@dataclass
class _Ref:
    name: str


# An expression: a str ("terminal"), a _Ref, ("seq", [items]), ("alt", [exprs]),
# ("rep", expr, min_count).
Expr = object


def productive_root(ebnf: str, root: str = "root") -> bool:
    """Whether rule `root` of xgrammar's printed grammar derives some finite string."""
    try:
        rules = {name: _parse(body) for name, body in _rules(ebnf)}
    except _Unknown:
        return True
    if root not in rules:
        return True
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in productive and _productive(expr, productive, rules):
                productive.add(name)
                changed = True
    return root in productive


def _rules(ebnf: str) -> list[tuple[str, str]]:
    out = []
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name.strip()):
            raise _Unknown(line)
        out.append((name.strip(), body))
    return out


def _tokens(body: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if m is None:
            raise _Unknown(body[pos:])
        kind = m.lastgroup if m.lastgroup not in ("lo", "hi") else "repeat"
        if m.group("repeat") is not None:
            kind = "repeat"
        out.append((kind or "", m.group(0).strip()))
        pos = m.end()
    return out


def _parse(body: str) -> Expr:
    tokens = _tokens(body)
    expr, i = _alt(tokens, 0)
    # What may follow the body is a lookahead assertion: it consumes nothing, so it is skipped.
    if i < len(tokens) and tokens[i][0] == "look":
        i = _skip_group(tokens, i)
    if i != len(tokens):
        raise _Unknown(body)
    return expr


def _skip_group(tokens: list[tuple[str, str]], i: int) -> int:
    depth = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if kind in ("look", "call") or text == "(":
            depth += 1
        elif text == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _Unknown("an unclosed lookahead")


def _alt(tokens: list[tuple[str, str]], i: int) -> tuple[Expr, int]:
    options = []
    seq, i = _seq(tokens, i)
    options.append(seq)
    while i < len(tokens) and tokens[i][1] == "|":
        seq, i = _seq(tokens, i + 1)
        options.append(seq)
    return ("alt", options), i


def _seq(tokens: list[tuple[str, str]], i: int) -> tuple[Expr, int]:
    items: list[Expr] = []
    while i < len(tokens):
        kind, text = tokens[i]
        if text in ("|", ")") or kind == "look":
            break
        if text == "(":
            item, i = _alt(tokens, i + 1)
            if i >= len(tokens) or tokens[i][1] != ")":
                raise _Unknown("an unclosed group")
            i += 1
        elif kind in ("string", "cls"):
            item, i = "terminal", i + 1
        elif kind == "call":  # a built-in such as Regex("...", json_string=true): a terminal
            item, i = "terminal", _skip_group(tokens, i)
        elif kind == "name":
            item, i = _Ref(text), i + 1
        else:
            raise _Unknown(text)
        while i < len(tokens) and (tokens[i][0] == "repeat" or tokens[i][1] in ("*", "+", "?")):
            kind, text = tokens[i]
            if text in ("*", "?"):
                item = ("rep", item, 0)
            elif text == "+":
                item = ("rep", item, 1)
            else:
                low = int(re.match(r"\{\s*(-?\d+)", text).group(1))  # type: ignore[union-attr]
                item = ("rep", item, max(low, 0))
            i += 1
        items.append(item)
    return ("seq", items), i


def _productive(expr: Expr, productive: set[str], rules: dict[str, Expr]) -> bool:
    if expr == "terminal":
        return True
    if isinstance(expr, _Ref):
        if expr.name not in rules:  # a name the printer knows and the reader does not
            return True
        return expr.name in productive
    assert isinstance(expr, tuple)
    if expr[0] == "seq":
        return all(_productive(e, productive, rules) for e in expr[1])
    if expr[0] == "alt":
        return any(_productive(e, productive, rules) for e in expr[1])
    _, inner, low = expr
    return low == 0 or _productive(inner, productive, rules)


MAX_REPETITION = 10_000
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def repetition(text: str) -> int:
    """The largest number of times one piece of a regex or EBNF text repeats: a bounded
    quantifier's count (`{m}`, `{m,n}`; `{m,}` counts m), times those of the groups around it.
    The compiler unrolls bounded repetition, so its time grows with this number
    (`(t1){1000000}` is 12 characters and compiles for minutes). Character classes and quoted
    literals are skipped."""
    # Spans of the groups, each with the count its quantifier gives it (1: none).
    groups: list[tuple[int, int, int]] = []  # (start, end, count)
    counts: list[tuple[int, int]] = []  # (position, count) of each quantifier
    opened: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class: up to its closing bracket
            j = i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c == '"':  # an EBNF literal
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            opened.append(i)
        elif c == ")" and opened:
            start = opened.pop()
            m = _QUANTIFIER.match(text, i + 1)
            if m is not None:
                groups.append((start, i, int(m.group(1)) if not m.group(2) else int(m.group(2))))
        elif c == "{":
            m = _QUANTIFIER.match(text, i)
            if m is not None:
                low, high = int(m.group(1)), m.group(2)
                counts.append((i, max(low, int(high)) if high else low))
                i = m.end()
                continue
        i += 1
    worst = 1
    for position, count in counts:
        for start, end, times in groups:
            if start < position and position < end:
                count *= times
        worst = max(worst, count)
    return worst
