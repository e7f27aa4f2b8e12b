"""Whether a grammar (``structured_outputs.grammar``) can end: every rule its start rule
reaches must derive some finite string.

A rule that only refers to itself (``root ::= root "a"``) derives nothing; neither backend
says so, and a request that takes such a rule can never finish as its grammar asks.
GBNF (``root ::= ...``) and Lark (``start: ...``) are read alike: literals, character
classes and regexes end; ``*``, ``?``, ``{0,n}``, ``~ 0..n`` and Lark's ``[...]`` may
derive nothing; a rule ends when one of its alternatives does. A grammar this reader
cannot follow is left to the backend. Torch-free.
"""

from __future__ import annotations

import re

_GBNF_RULE = re.compile(r"^\s*([A-Za-z_][\w.-]*)\s*::=", re.M)
_LARK_RULE = re.compile(r"^[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*|//[^\n]*)
  | (?P<literal>"(?:\\.|[^"\\])*"i?|'(?:\\.|[^'\\])*'i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<bounds>\{\s*\d*\s*(?:,\s*-?\d*\s*)?\})
  | (?P<tilde>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<name>[A-Za-z_][\w.-]*)
  | (?P<arrow>->\s*[A-Za-z_]\w*)
  | (?P<op>\(=|\(!|[()|*+?\[\]])
""", re.X)

_Node = tuple  # ("lit",) | ("ref", name) | ("alt", [[node, ...], ...]) | ("opt", node)


def _tokens(body: str, lark: bool) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None:
            raise ValueError(body[pos:pos + 20])
        pos = m.end()
        kind = m.lastgroup
        if kind in ("space", "comment", "arrow"):
            continue
        if kind == "cls" and lark:  # Lark's [...] is an optional group: split it
            out += [("op", "[")] + _tokens(m.group()[1:-1], lark) + [("op", "]")]
            continue
        out.append((kind, m.group()))
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.t, self.i = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def alternatives(self, close: str | None) -> _Node:
        alts = [self.sequence(close)]
        while self.peek() == ("op", "|"):
            self.i += 1
            alts.append(self.sequence(close))
        return ("alt", alts)

    def sequence(self, close: str | None) -> list[_Node]:
        seq = []
        while (tok := self.peek()) is not None and tok != ("op", "|") and tok != ("op", close):
            seq.append(self.postfix(self.atom()))
        return seq

    def atom(self) -> _Node:
        kind, text = self.t[self.i]
        self.i += 1
        if kind in ("literal", "regex", "cls"):
            return ("lit",)
        if kind == "name":
            return ("ref", text)
        if text in ("(", "(=", "(!", "["):
            close = "]" if text == "[" else ")"
            inner = self.alternatives(close)
            if self.peek() != ("op", close):
                raise ValueError(text)
            self.i += 1
            if text in ("(=", "(!"):
                return ("alt", [[]])  # a lookahead consumes nothing
            return ("opt", inner) if text == "[" else inner
        raise ValueError(text)

    def postfix(self, node: _Node) -> _Node:
        while (tok := self.peek()) is not None:
            kind, text = tok
            if text in ("*", "?") and kind == "op":
                node = ("opt", node)
            elif text == "+" and kind == "op":
                pass
            elif kind == "bounds":
                low = text[1:-1].split(",")[0].strip()
                if low in ("", "0"):
                    node = ("opt", node)
            elif kind == "tilde":
                if re.match(r"~\s*0(?!\d)", text):
                    node = ("opt", node)
            else:
                break
            self.i += 1
        return node


def _rules(text: str) -> tuple[dict[str, _Node], str] | None:
    lark = "::=" not in text
    head = _LARK_RULE if lark else _GBNF_RULE
    if lark:  # directives (%import, %ignore, %llguidance) are not rules
        text = "\n".join(line for line in text.splitlines()
                         if not line.lstrip().startswith("%"))
    starts = list(head.finditer(text))
    if not starts:
        return None
    rules: dict[str, _Node] = {}
    for k, m in enumerate(starts):
        end = starts[k + 1].start() if k + 1 < len(starts) else len(text)
        p = _Parser(_tokens(text[m.end():end], lark))
        node = p.alternatives(None)
        if p.peek() is not None:
            raise ValueError(p.peek()[1])
        name = m.group(1)
        if name in rules:  # Lark may add alternatives to a rule in a second definition
            node = ("alt", rules[name][1] + node[1])
        rules[name] = node
    return rules, "start" if lark else "root"


def _ends(node: _Node, done: set[str], rules: dict[str, _Node]) -> bool:
    tag = node[0]
    if tag in ("lit", "opt"):
        return True
    if tag == "ref":
        return node[1] in done or node[1] not in rules  # undefined: the backend says so
    return any(all(_ends(n, done, rules) for n in seq) for seq in node[1])


def _refs(node: _Node, out: set[str]) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if n[0] == "ref":
            out.add(n[1])
        elif n[0] == "opt":
            stack.append(n[1])
        elif n[0] == "alt":
            stack += [x for seq in n[1] for x in seq]


def endless_rule(grammar: str) -> str | None:
    """The first rule reached from the start rule that derives no finite string, or
    None (also when the grammar is one this reader cannot follow)."""
    try:
        found = _rules(grammar)
        return None if found is None else _first_endless(*found)
    except (ValueError, IndexError, RecursionError):  # groups nested past the stack
        return None


def _first_endless(rules: dict[str, _Node], start: str) -> str | None:
    if start not in rules:
        return None
    done: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, node in rules.items():
            if name not in done and _ends(node, done, rules):
                done.add(name)
                changed = True
    reached, order, todo = {start}, [start], [start]
    while todo:
        refs: set[str] = set()
        _refs(rules[todo.pop()], refs)
        for r in sorted(refs - reached):
            if r in rules:
                reached.add(r)
                order.append(r)
                todo.append(r)
    return next((r for r in order if r not in done), None)
