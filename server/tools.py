"""``tools`` and ``tool_choice`` on chat completions.

``none``: the tools are rendered, nothing is parsed. ``auto``: the model chooses; its
text goes through the server's ``--tool-call-parser``. ``required`` and a named function
are enforced by a grammar built from the tools' JSON schemas: a JSON array of
``{"name", "arguments"}`` calls (one, with ``parallel_tool_calls: false``), or the named
function's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.state import ServeOptions
from pagedserve.server.structured import Constraint, _make

_ANY_OBJECT = {"type": "object"}


@dataclass(slots=True)
class ToolPlan:
    tools: list[dict] | None
    """The tools as the chat template receives them (None without tools)."""
    parser: str | None = None
    """``hermes``, ``required`` or ``named``; None: the text is content."""
    function_name: str | None = None
    constraint: Constraint | None = None


def _check_tools(tools: list[Any]) -> list[dict]:
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\": ..., \"parameters\": ...}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              "tools")
        out.append(t)
    return out


def _params_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or _ANY_OBJECT


def tool_plan(req: ChatCompletionRequest, options: ServeOptions) -> ToolPlan:
    if req.functions:
        raise bad_request("functions are not supported; use tools", "functions")
    if req.function_call not in (None, "none"):
        raise bad_request("function_call is not supported; use tool_choice", "function_call")
    tools = _check_tools(req.tools) if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan(tools)
    if tools is None:
        raise bad_request(f"tool_choice={choice!r} needs tools", "tool_choice")
    if choice == "auto":
        if not options.enable_auto_tool_choice or options.tool_call_parser is None:
            raise bad_request(
                "tools with tool_choice 'auto' need the server started with "
                "--enable-auto-tool-choice and --tool-call-parser",
                "tool_choice" if req.tool_choice is not None else "tools")
        return ToolPlan(tools, options.tool_call_parser)
    names = {"json": "tools[*].function.parameters"}
    if choice == "required":
        calls = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]}, "arguments": _params_of(t)},
            "required": ["name", "arguments"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(tools, "required", None, _make("tools", names, json=schema))
    name = _named(choice)
    match = [t for t in tools if t["function"]["name"] == name]
    if not match:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                          f"({', '.join(t['function']['name'] for t in tools)})", "tool_choice")
    return ToolPlan(tools, "named", name, _make("tools", names, json=_params_of(match[0])))


def with_tool_constraint(constraint: Constraint | None, plan: ToolPlan,
                         tool_choice: Any) -> Constraint | None:
    """The request's one constraint: its own (``response_format``, ...) or that of its
    ``tool_choice``; both at once is a 400."""
    if constraint is not None and plan.constraint is not None:
        raise bad_request(f"{constraint.param} cannot be combined with tool_choice "
                          f"{tool_choice!r}, which constrains the output itself",
                          constraint.param)
    return constraint or plan.constraint


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice")
    return fn["name"]

