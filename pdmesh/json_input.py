"""JSON a client sends, parsed within limits: an HTTP body, or a JSON text inside a request (a
JSON schema, a tool's parameters, a tool call's arguments). Torch-free.

Python's `json` module has no limits of its own that a server can answer as bad input: an
integer literal of more than 4,300 digits raises a bare ValueError (the int-string conversion
limit), a few hundred levels of nesting parse but overflow the stack of whoever walks the value
next (RecursionError), and ~1,000 overflow the parser itself. Here every such value is refused
with an `InvalidRequest` that names where it is (`max_tokens`, `tools[0].function.parameters.
properties.a`), before anything else reads it:

- nesting deeper than MAX_JSON_DEPTH arrays and objects;
- integer literals of more than MAX_INT_DIGITS digits (beyond any 128-bit integer; a field
  with a narrower range, a token id or a seed, checks its own);
- in JSON texts (not a whole body, whose unread fields may hold anything), strings that are not
  valid Unicode (a lone-surrogate escape such as "\\ud800").
"""

from __future__ import annotations

import json
from typing import Any

from pdmesh.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; JSON schemas need a dozen at most
MAX_INT_DIGITS = 40  # 2**128 has 39
PATH_LEVELS = 8  # below a field, the levels of nesting an error's path names
_MAX_KEY_CHARS = 40  # of an object key, in the path an error names


class _LongInt:
    """What an integer literal of more than MAX_INT_DIGITS digits parses to: no int is built
    (over 4,300 digits Python refuses to), and the walk below finds it and names its path."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


# Every digit as "0", anything else as " ": a run of MAX_INT_DIGITS + 1 zeros then marks a
# digit run that may be a long integer (a substring search, far faster than a regex).
_DIGITS_ONLY = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)


def _parse_int(literal: str) -> int | _LongInt:
    digits = len(literal) - literal.startswith("-")
    return int(literal) if digits <= MAX_INT_DIGITS else _LongInt(digits)


def parse_json(data: str | bytes, field: str | None = None) -> Any:
    """`data` (UTF-8 bytes or text) as Python values. `field`: where the text sits in the
    request (None: it is the request body); InvalidRequest naming it, or the path inside it, when
    the text is not JSON or breaks a limit. JSON texts (`field` given) must hold valid Unicode."""
    what = field if field is not None else "the request body"
    # Parsing every integer through a Python function costs; most texts hold no long digit run.
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    hook = _parse_int if _LONG_RUN in raw.translate(_DIGITS_ONLY) else None
    try:
        value = json.loads(data, parse_int=hook)
    except RecursionError:
        raise InvalidRequest(
            f"{what} is nested more than {MAX_JSON_DEPTH} arrays or objects deep.", field
        ) from None
    except UnicodeDecodeError as e:
        message = f"{what} is not UTF-8 text: {e.reason} at byte {e.start}."
        raise InvalidRequest(message, field) from None
    except ValueError as e:  # JSONDecodeError, and whatever else the parser refuses
        raise InvalidRequest(f"{what} is not valid JSON: {e}.", field) from None
    check_json(value, field, text=field is not None)
    return value


def check_json(value: Any, field: str | None = None, text: bool = False) -> None:
    """InvalidRequest when `value` (parsed JSON at `field`; None: the request body) nests arrays
    and objects more than MAX_JSON_DEPTH deep or holds an integer of more than MAX_INT_DIGITS
    digits; with `text`, a string (key or value) that is not valid Unicode too. The error names
    the path of the culprit (`tools[0].function.parameters.x`), or of its ancestor PATH_LEVELS
    below `field` when it sits deeper. Iterative: no depth can overflow the stack here."""
    root = field or ""
    # What the walk must look at (scalars that are neither are skipped at C speed: a body may be
    # a list of millions of token ids).
    kinds = {dict, list, _LongInt, str} if text else {dict, list, _LongInt}
    # (value, its path, its depth, whether the path is its own rather than an ancestor's)
    stack: list[tuple[Any, str, int, bool]] = [(value, root, 0, True)]
    while stack:
        v, path, depth, own = stack.pop()
        if isinstance(v, dict | list):
            if depth >= MAX_JSON_DEPTH:
                is_ = f"is nested more than {MAX_JSON_DEPTH} arrays or objects deep"
                holds = f"holds arrays or objects nested more than {MAX_JSON_DEPTH} deep"
                raise _refuse(path, own, is_, holds)
            named = depth < PATH_LEVELS
            if isinstance(v, list):
                if not any(map(kinds.__contains__, map(type, v))):
                    continue
                found = [i for i, x in enumerate(v) if x.__class__ in kinds]
                stack.extend(
                    (v[i], f"{path}[{i}]" if named else path, depth + 1, named) for i in found
                )
                continue
            for k, x in v.items():
                key = _path(path, k) if named else path
                if text:
                    check_text(k, key)
                stack.append((x, key, depth + 1, named))
        elif v.__class__ is _LongInt:
            long = f"an integer of {v.digits} digits (at most {MAX_INT_DIGITS} are accepted)"
            raise _refuse(path, own, f"is {long}", f"holds {long}")
        elif text and isinstance(v, str):
            check_text(v, path)


def _refuse(path: str, own: bool, is_: str, holds: str) -> InvalidRequest:
    """The error naming `path` (the body when empty): what it `is_`, or what it `holds` when
    the culprit sits deeper than the path names."""
    if not path:
        return InvalidRequest(f"the request body {is_ if own else holds}.")
    return InvalidRequest(f"{path} {is_ if own else holds}.", path)


def _path(path: str, key: str) -> str:
    """`path.key`, the key cut short and escaped to printable ASCII (paths go into error
    messages and gRPC metadata)."""
    if len(key) > _MAX_KEY_CHARS:
        key = key[:_MAX_KEY_CHARS] + "..."
    key = key.encode("unicode_escape").decode()
    return f"{path}.{key}" if path else key


def check_text(value: str, name: str) -> str:
    """`value` when it is text that can be encoded (UTF-8). JSON's `\\ud800` escapes (a lone
    surrogate, not a character) decode to a Python str that cannot: the tokenizer, protobuf and
    the workers would all fail on it, so it is refused here, naming the field. (Protobuf refuses
    such strings on the wire: JSON is where they come from.)"""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{name} is not valid Unicode text: {value[e.start : e.end]!r} at character "
            f"{e.start} is a lone surrogate (a \\uD800-\\uDFFF escape that is not half of a pair).",
            name,
        ) from None
    return value
