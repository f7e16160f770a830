"""OpenAI-style tool calling for a chat model: the prompt that lists the tools, the grammar that makes
a call parse, and the parser that turns the reply back into `tool_calls`.

The format is the one SmolLM2-Instruct was trained on (its function-calling data, Argilla's
Synth-APIGen, as its model card and Ollama's template for it show): the tools go into the system
turn as JSON inside `<tools>...</tools>`, and the assistant answers with a JSON list of calls,

    <tool_call>[
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]</tool_call>

A tool result goes back as a user turn wrapped in `<tool_response>...</tool_response>`. The grammar
(`tool_call_constraint`) forces the tool names and each tool's parameter schema, so a call always
parses and validates; with `tool_choice: "auto"` the model may answer in plain text instead.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edgefinfer.errors import UserError
from edgefinfer.decoding.structured import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def parse_tools(tools: list[Any]) -> list[Tool]:
    """OpenAI's `tools` ([{"type": "function", "function": {"name", "description", "parameters"}}])."""
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UserError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{...}}}}}}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise UserError(f"tools[{i}]: a function name is 1-64 letters, digits, '_', '.' or '-', got {fn['name']!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise UserError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(Tool(fn["name"], str(fn.get("description") or ""), params))
    if len({t.name for t in out}) != len(out):
        raise UserError("tools have duplicate function names")
    return out


def parse_tool_choice(choice: Any, tools: list[Tool]) -> str:
    """"none" | "auto" | "required" | the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise UserError(f"tool_choice {choice!r} needs tools")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t.name for t in tools}:
            raise UserError(f"tool_choice names the function {name!r}, which is not in tools")
        return name
    raise UserError("tool_choice must be \"none\", \"auto\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def system_prompt(tools: list[Tool]) -> str:
    listing = json.dumps([t.as_json() for t in tools], ensure_ascii=False)
    return ("You are an expert in composing functions. You are given a question and a set of possible functions. "
            "Based on the question, make one or more function calls to achieve the purpose. If none of the functions "
            "can be used, say so.\n"
            f"You have access to the following tools:\n<tools>{listing}</tools>\n"
            "Answer a function call in exactly this format, with no other text:\n"
            f"{OPEN}[\n{{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\"}}}},\n"
            f"(more tool calls as required)\n]{CLOSE}")


def render_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """Chat messages with tools, in the model's own format, ready for its chat template: the tool list
    opens the system turn, an assistant's `tool_calls` become its call text, a tool result a user turn."""
    out: list[dict[str, str]] = []
    if tools:
        system = system_prompt(tools)
        if messages and messages[0]["role"] in ("system", "developer") and messages[0].get("content"):
            system += "\n\n" + messages[0]["content"]
        out.append({"role": "system", "content": system})
        if messages and messages[0]["role"] in ("system", "developer"):
            messages = messages[1:]
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": format_calls(m["tool_calls"])})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def format_calls(tool_calls: list[Any]) -> str:
    """OpenAI `tool_calls` (arguments as JSON text) -> the model's call text."""
    items = []
    for c in tool_calls:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (json.JSONDecodeError, TypeError):
            raise UserError(f"a tool call's arguments are not JSON: {fn.get('arguments')!r}") from None
        items.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
    return f"{OPEN}[\n" + ",\n".join(items) + f"\n]{CLOSE}"


def tool_call_constraint(tools: list[Tool], choice: str, parallel: bool = True) -> Constraint | None:
    """The grammar of a reply: a call list whose names and arguments follow the tools' schemas; with
    "auto" also plain text (any reply that does not start with '<'). A named function is called exactly
    once (OpenAI's "forced function"; vLLM's named tool choice alike). None for "none"."""
    if choice == "none":
        return None
    named = choice not in ("auto", "required")
    parallel = parallel and not named
    chosen = [t for t in tools if not named or t.name == choice]
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _closed(t.parameters)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in chosen],
            "x-guidance": _JSON_STYLE}
    more = ' (",\\n" call)*' if parallel else ""
    calls = f'call{more}' if choice != "auto" else f'(call{more})?'
    lines = [f'start: {"calls | text" if choice == "auto" else "calls"}',
             f'calls: "{OPEN}[\\n" {calls} "\\n]{CLOSE}"',
             f"call: %json {json.dumps(call)}"]
    if choice == "auto":
        lines.append(r'text: /[^<][\s\S]*/')
    return Constraint.grammar("\n".join(lines) + "\n")


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """An object schema that does not say otherwise takes no properties beyond its own (as OpenAI's
    strict function calling requires): else a small model fills the arguments with invented keys."""
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The reply's calls as OpenAI `tool_calls`, or None when the reply is not a call list."""
    match = re.fullmatch(rf"\s*{re.escape(OPEN)}(.*){re.escape(CLOSE)}\s*", text, flags=re.S)
    if match is None:
        return None
    try:
        calls = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
            for c in calls]


def could_be_call(text: str) -> bool:
    """Whether a reply that begins with `text` may still turn out to be a call list (a stream holds it back)."""
    head = text.lstrip()
    return OPEN.startswith(head) or head.startswith(OPEN)
