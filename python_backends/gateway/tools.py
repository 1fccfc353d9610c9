"""Tool calling: OpenAI's `tools`, `tool_choice` and the messages that carry calls and their
results, rendered into the prompt; the model's calls parsed out of its text.

The calls are written in the Hermes format that Qwen's and Hermes' chat templates teach:
one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call. A checkpoint
whose chat template takes `tools` renders them itself; for one whose template does not (the
default SmolLM2), the tools and the call format are described in the system message, calls the
assistant made are written back as blocks and tool results sent as `<tool_response>` user
turns. `tool_choice` `required` and a named function constrain the output with a grammar
(engine-side, as any structured output), so the arguments always parse and match the
function's schema; `auto` leaves the model free and parses what it wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from python_backends.gateway.errors import invalid
from python_backends.gateway.stops import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The JSON inside a block, as the grammar writes it: the separators the guides use for JSON
# (no free whitespace, guides.grammar says why).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parse_tools(value: Any) -> list[dict[str, Any]]:
    """`tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}; the functions, as given."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools", "a list of tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                tool.get("function"), dict):
            raise invalid(where, 'each tool is {"type": "function", "function": {...}}')
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"{where}.function.name", "a non-empty string is required")
        if not isinstance(fn.get("parameters", {}), dict):
            raise invalid(f"{where}.function.parameters", "a JSON schema object")
        if any(f["name"] == fn["name"] for f in functions):
            raise invalid(f"{where}.function.name", f"{fn['name']!r} is given twice")
        functions.append(fn)
    return functions


def parse_tool_choice(value: Any, functions: list[dict[str, Any]]) -> str:
    """`tool_choice`: "none", "auto", "required", or {"type": "function", "function":
    {"name"}}; read as that name. Without it: "auto" when there are tools, else "none"."""
    if value is None:
        return "auto" if functions else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not functions:
            raise invalid("tool_choice", f"{value!r} needs tools")
        return str(value)
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or value.get("type") != "function":
        raise invalid("tool_choice", 'none, auto, required or {"type": "function", '
                      '"function": {"name": ...}}')
    if name in ("none", "auto", "required") or not any(f["name"] == name for f in functions):
        raise invalid("tool_choice", f"no tool is named {name!r}")
    return name


def parse_message(where: str, m: dict[str, Any], content: str | None) -> dict[str, Any]:
    """An assistant message's `tool_calls` or a tool message's `tool_call_id`, checked; the
    message as the gateway keeps it (arguments as the JSON text the client sent)."""
    out: dict[str, Any] = {"role": m["role"], "content": content or ""}
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise invalid(f"{where}.tool_call_id", "a tool message names the call it answers")
        out["tool_call_id"] = m["tool_call_id"]
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", "a list of calls")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                    fn.get("arguments"), str):
                raise invalid(f"{where}.tool_calls[{j}]", 'each call is {"id", "type": '
                              '"function", "function": {"name", "arguments": "<JSON text>"}}')
            try:
                json.loads(fn["arguments"])
            except ValueError:
                raise invalid(f"{where}.tool_calls[{j}].function.arguments",
                              "not JSON") from None
            out["tool_calls"].append({"id": str(call.get("id", "")), "type": "function",
                                      "function": {"name": fn["name"],
                                                   "arguments": fn["arguments"]}})
    return out


def template_takes_tools(tokenizer: Any) -> bool:
    return "tools" in str(getattr(tokenizer, "chat_template", "") or "")


def conversation(messages: list[dict[str, Any]], functions: list[dict[str, Any]],
                 native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template is given them. `native`: the template renders tools,
    calls and results itself (arguments as objects, as Hugging Face templates take them);
    else they are written into the messages here (the module's docstring)."""
    if native:
        return [_with_argument_objects(m) for m in messages]
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [_block(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in m["tool_calls"]]
            out.append({"role": "assistant",
                        "content": "\n".join(filter(None, [m["content"], *blocks]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if functions:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{_guide(functions)}"}
        else:
            out.insert(0, {"role": "system", "content": _guide(functions)})
    return out


def _with_argument_objects(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {"name": c["function"]["name"],
                                "arguments": json.loads(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _guide(functions: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return ("You can call the functions below, described as JSON schemas.\n<tools>\n"
            f"{listed}\n</tools>\nTo call one, write one block per call:\n{OPEN}\n"
            '{"name": <the function\'s name>, "arguments": <its arguments, a JSON object>}\n'
            f"{CLOSE}\nEach call's result comes back inside <tool_response></tool_response>.")


def _block(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def call_grammar(functions: list[dict[str, Any]], choice: str, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, with inline JSON schemas) for `tool_choice` `required`
    (a call of any of the functions; more than one if `parallel`) or a named function (one
    call of it)."""
    chosen = functions if choice == "required" else [f for f in functions if f["name"] == choice]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}}
             for f in chosen]
    schema = {"x-guidance": _JSON_STYLE, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    more = ' ("\\n" call)*' if choice == "required" and parallel else ""
    return (f"start: call{more}\n"
            f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
            f"body: %json {json.dumps(schema)}")


@dataclass
class ToolCalls:
    """Reads one choice's text as it streams: the text outside call blocks (content), and each
    call once its block closes. Text that could begin a block is held back until decided; a
    block that is not a call of a known function stays text."""

    names: frozenset[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    _pending: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that can go out now, calls completed by this text)."""
        self._pending += text
        content, done = "", []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._in_call = False
                call = self._call(body)
                if call is None:
                    content += OPEN + body + CLOSE
                else:
                    done.append(call)
                continue
            start = self._pending.find(OPEN)
            if start < 0:
                keep = partial_suffix(self._pending, [OPEN])
                content += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content += self._pending[:start]
            self._pending = self._pending[start + len(OPEN):]
            self._in_call = True
        return content, done

    def flush(self) -> str:
        """The output ended: an unfinished block or held-back text is content."""
        rest = (OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return rest

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names or not isinstance(
                value.get("arguments", {}), dict):
            return None
        call = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": value["name"],
                             "arguments": json.dumps(value.get("arguments", {}))}}
        self.calls.append(call)
        return call
