"""Just enough PromQL to tell which series an expression selects and which labels it names.

Whether an expression is valid is promtool's business (tests/test_monitoring.py runs
``promtool check rules`` on every expression first); this walks the tokens of one it accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""
      (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<comment>\#[^\n]*)
    | (?P<number>\.?[0-9][0-9a-zA-Z_.]*)
    | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@])
    | (?P<space>\s+)
    """,
    re.VERBOSE,
)
#: Words that are not series: binary operators, modifiers, literals, aggregations.
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "atan2", "inf", "nan"}
_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
#: Followed by a parenthesised list of label names.
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
#: Functions that read a counter; a gauge read through them is a mistake, and so is a counter
#: read without them.
RATES = {"rate", "irate", "increase"}
_MATCH_OPS = {"=", "!=", "=~", "!~"}


@dataclass
class Selector:
    name: str | None
    matchers: set[str]  # the label names it matches on
    in_rate: bool  # inside rate(), irate() or increase()


@dataclass
class Analysis:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # by/without/on/ignoring/group_x labels


def tokens(expr: str) -> list[tuple[str, str]]:
    found, at = [], 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise ValueError(f"cannot read {expr[at : at + 20]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            found.append((kind, match.group()))
        at = match.end()
    return found


def analyse(expr: str) -> Analysis:
    toks = tokens(expr)
    result = Analysis()
    calls: list[str | None] = []  # for each open parenthesis: the function it calls, if any
    i = 0

    def peek(offset: int = 1) -> str | None:
        return toks[i + offset][1] if i + offset < len(toks) else None

    def read_until(closing: str) -> list[tuple[str, str]]:
        nonlocal i
        start = i + 1
        while toks[i][1] != closing:
            i += 1
        return toks[start:i]

    while i < len(toks):
        kind, text = toks[i]
        if kind == "ident" and text in _GROUPING:
            if peek() == "(":
                i += 1
                result.grouping |= {t for k, t in read_until(")") if k == "ident"}
        elif kind == "ident" and peek() == "(":
            calls.append(text)
            i += 1
        elif kind == "ident" and text.lower() not in _KEYWORDS | _AGGREGATIONS:
            matchers: set[str] = set()
            if peek() == "{":
                i += 1
                inside = read_until("}")
                matchers = {
                    t
                    for n, (k, t) in enumerate(inside[:-1])
                    if k == "ident" and inside[n + 1][1] in _MATCH_OPS
                }
            result.selectors.append(Selector(text, matchers, any(c in RATES for c in calls)))
        elif text == "{":  # a selector by matchers alone
            inside = read_until("}")
            names = [t for k, t in inside if k == "ident"]
            result.selectors.append(Selector(None, set(names), any(c in RATES for c in calls)))
        elif text == "[":
            read_until("]")  # a range or a subquery's durations
        elif text == "(":
            calls.append(None)
        elif text == ")":
            calls.pop()
        i += 1
    return result
