"""The OpenAI chat-completions wire format as the agent endpoint reads and writes it
(:mod:`megarl.rewards.agent_endpoint`): requests checked and turned into what a chat template
takes, responses built from what the engine generated.

A request (``POST /v1/chat/completions``): ``messages`` (system, user, assistant, tool; content
a string or text parts; an assistant's ``tool_calls`` with ``function.arguments`` as a JSON
string), ``tools`` (function schemas, passed to the template), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``tool_choice`` (``auto`` or
``none``), ``n`` (1). ``model`` is named in the reply as the endpoint serves it, whatever the
request says; ``seed`` is ignored (the run seeds each session, so runs reproduce), and so are
``temperature`` / ``top_p`` unless the endpoint lets requests set them (``pin_sampling``).

Invariants: tool-call arguments reach the template as objects (as vLLM gives them, so Hermes /
Qwen templates write back the JSON the model wrote); anything that would sample from another
distribution than the policy being trained — ``stream``, ``n`` > 1, penalties, ``logit_bias``,
a required or named ``tool_choice``, a JSON ``response_format`` — is refused with 400 naming
the field, never silently ignored. Not here: rendering, generation, credentials (the endpoint's).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.rewards.tool_calls import ToolCall

ROLES = ("system", "user", "assistant", "tool")
REFUSED_IF_SET = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs")
"""Fields that change what is sampled (or what is returned) from the trained policy's defaults."""


class WireError(ValueError):
    """A request the endpoint refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        return error_body(str(self), kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request."""

    messages: list[dict[str, Any]]
    """As the chat template takes them: content strings, tool-call arguments as objects."""
    tools: list[dict[str, Any]]
    max_tokens: int | None
    """What the agent asked for at most (None: the endpoint's cap)."""
    temperature: float | None
    top_p: float | None
    stop: list[str]
    parse_tools: bool
    """False for ``tool_choice: none``: the turn is returned as text."""


def read_request(body: Any) -> ChatRequest:
    """``body`` (parsed JSON) as a :class:`ChatRequest`; WireError (400) naming the field."""
    if not isinstance(body, dict):
        raise WireError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError(400, "messages must be a non-empty list", "messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise WireError(400, 'tools must be a list of {"type": "function", "function": {"name": ...}}', "tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise WireError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise WireError(400, "stop must be a string or a list of non-empty strings", "stop")
    return ChatRequest(
        messages=[_message(i, m) for i, m in enumerate(messages)],
        tools=tools,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", lambda v: 0 <= v <= 2, "in [0, 2]"),
        top_p=_number(body, "top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        stop=stop,
        parse_tools=body.get("tool_choice") != "none",
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise WireError(400, "stream is not supported: ask for the whole completion", "stream")
    if body.get("n", 1) != 1:
        raise WireError(400, f"n={body['n']!r}: one completion per request (n=1)", "n")
    if body.get("tool_choice", "auto") not in ("auto", "none"):
        raise WireError(400, "tool_choice must be auto or none (a forced call would not be the policy's)",
                        "tool_choice")  # fmt: skip
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise WireError(400, "response_format: only text (constrained decoding is not the policy)", "response_format")
    for name in REFUSED_IF_SET:
        if body.get(name):
            raise WireError(400, f"{name}={body[name]!r} is not supported (sampling follows the trained policy)", name)


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else m
        raise WireError(400, f"{where}.role is {role!r}, not one of {', '.join(ROLES)}", f"{where}.role")
    out: dict[str, Any] = {"role": m["role"], "content": _content(where, m.get("content"), m["role"])}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(where, m["tool_calls"])
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise WireError(400, f"{where} (a tool message) needs a tool_call_id string", f"{where}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _content(where: str, value: Any, role: str) -> str:
    """A message's content as one string: text parts joined; None only for an assistant turn."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise WireError(400, f"{where}.content[{j}] is {kind!r}: only text parts", f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise WireError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant's ``tool_calls`` with their arguments parsed (templates write them as JSON)."""
    if not isinstance(calls, list):
        raise WireError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise WireError(400, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', at)
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise WireError(400, f"{at}.function.arguments is not JSON ({e.msg})", f"{at}.function.arguments") from None
        if not isinstance(args, dict):
            raise WireError(400, f"{at}.function.arguments is not a JSON object", f"{at}.function.arguments")
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def completion(
    model: str,
    text: str,
    calls: list[ToolCall],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    call_number: int,
) -> dict[str, Any]:
    """The reply to a chat-completions request. Tool calls get ids ``call_<n>_<k>`` (n: the
    session's call number), so a replayed session writes the same ids back into its prompts."""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{call_number}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for k, c in enumerate(calls)
        ]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def models(model: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "megarl"}]}


def _is_function(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, ok: Callable[[float], bool], rule: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireError(400, f"{name} must be a number, got {value!r}", name)
    if not ok(value):
        raise WireError(400, f"{name}={value} must be {rule}", name)
    return float(value)
