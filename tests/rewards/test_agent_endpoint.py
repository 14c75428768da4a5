"""The agent endpoint (``megarl.rewards.agent_endpoint``), served for real over HTTP and rendered
with a real HF tokenizer and a Qwen2.5-style chat template (tools and tool calls written as
Qwen2.5 writes them). ``generate`` is a stand-in returning scripted ids — the text a model
would write, tokenised — so the recorded ids can be checked exactly against the template's own
rendering of the whole conversation.

Checked: a two-call tool conversation in the OpenAI wire shape (raw HTTP, and the ``openai``
client through ``env.agent``); the episode's ids equal the rendered conversation; strangers,
wrong and closed keys get 401 and nothing is recorded; two concurrent sessions do not mix; a
history rewrite starts a new segment and says why; stop strings, limits, refusals.
"""

from __future__ import annotations

import copy
import http.client
import json
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from megarl.config import ConfigError
from megarl.config.env import EnvConfig
from megarl.data.hf_tokenizer import HFTokenizer
from megarl.rewards.agent import import_agent, run_agent
from megarl.rewards.agent_endpoint import AgentEndpoint, EndpointSettings
from megarl.rewards.env import EnvSpecError
from megarl.rewards.tool_env import CALCULATOR, calculator
from tests.helpers import tiny_hf_tokenizer

QWEN25_TOOLS = """\
{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall a function within <tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""Qwen2.5-Instruct's template, shortened: tools in the system turn, an assistant's tool calls as
``\\n<tool_call>\\n{json}\\n</tool_call>``, tool results as a user turn of ``<tool_response>``s."""

CALL = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
SCRIPT = {  # the question → what the "model" writes at each turn (turn = tool responses so far)
    "what is 2+3?": ["Let me compute." + CALL % "2+3", "The answer is 5."],
    "what is 7*6?": ["I will use the tool." + CALL % "7*6", "It is 42."],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tiny_hf_tokenizer(tmp_path_factory.mktemp("tok"), vocab=400)
    (folder / "qwen25_tools.jinja").write_text(QWEN25_TOOLS)
    return folder


@pytest.fixture(scope="module")
def tok(folder: Path) -> HFTokenizer:
    return HFTokenizer(folder, chat_template=str(folder / "qwen25_tools.jinja"))


@pytest.fixture(scope="module")
def engine_tok(folder: Path) -> HFTokenizer:
    """The stand-in engine's own instance (a fast tokenizer is not shared between threads)."""
    return HFTokenizer(folder, chat_template=str(folder / "qwen25_tools.jinja"))


class Scripted:
    """A stand-in engine: the scripted turn for the conversation's question, tokenised, closed
    with <|im_end|>, with made-up log-probs; every call it gets is kept."""

    def __init__(self, tok: HFTokenizer, barrier: threading.Barrier | None = None) -> None:
        self.tok, self.barrier, self.calls = tok, barrier, []
        self.lock = threading.Lock()

    def ids_of(self, question: str, turn: int) -> list[int]:
        return [*self.tok.encode(SCRIPT[question][turn], bos=False), self.tok.eos_ids[0]]

    def __call__(
        self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, seed: int, episode: int
    ) -> Any:
        if self.barrier is not None:
            self.barrier.wait(timeout=30)  # both sessions' calls are in flight at once
        text = self.tok.hf.decode(prompt)
        question = next(q for q in SCRIPT if q in text)
        full = self.ids_of(question, text.count("<tool_response>"))
        with self.lock:
            self.calls.append((prompt, max_tokens, temperature, top_p, seed))
        ids = full[:max_tokens]
        return ids, [-0.01 * (k + 1) for k in range(len(ids))], "stop" if len(full) <= max_tokens else "length"


@pytest.fixture
def serve(tok: HFTokenizer, engine_tok: HFTokenizer) -> Any:
    endpoints: list[AgentEndpoint] = []

    def start(generate: Any = None, **settings: Any) -> AgentEndpoint:
        kw = {"max_tokens": 256, "max_context": 1024, "temperature": 0.7, "top_p": 0.9, "model": "policy"} | settings
        endpoint = AgentEndpoint(tok, generate or Scripted(engine_tok), EndpointSettings(**kw))
        endpoint.start()
        endpoints.append(endpoint)
        return endpoint

    yield start
    for e in endpoints:
        e.stop()


def post(endpoint: AgentEndpoint, body: Any, key: str | None, path: str = "/v1/chat/completions") -> tuple[int, Any]:
    """One request over a fresh connection, as any HTTP client sends it; (status, JSON reply)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(endpoint.url.rsplit(":", 1)[1]), timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST" if body is not None else "GET", path, body=data if body is not None else None, headers=headers)
    reply = conn.getresponse()
    status, payload = reply.status, json.loads(reply.read())
    conn.close()
    return status, payload


def converse(endpoint: AgentEndpoint, key: str, question: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A two-call agent: ask, run the tool it calls, send the result back. (messages, replies)"""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    status, first = post(endpoint, {"model": "any", "messages": messages, "tools": [CALCULATOR]}, key)
    assert status == 200, first
    message = first["choices"][0]["message"]
    (call,) = message["tool_calls"]
    result = calculator(json.loads(call["function"]["arguments"]))
    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": result}]
    status, second = post(endpoint, {"model": "any", "messages": messages, "tools": [CALCULATOR]}, key)
    assert status == 200, second
    return messages, [first, second]


def template_ids(tok: HFTokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """The conversation as the tokenizer's own template renders it (arguments as objects)."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    ids = tok.hf.apply_chat_template(messages, tools=[CALCULATOR], chat_template=tok.template, tokenize=True,
                                     add_generation_prompt=generation_prompt, return_dict=False)  # fmt: skip
    return [int(i) for i in ids]


def test_two_call_tool_conversation_round_trips_and_records_the_rendered_ids(
    tok: HFTokenizer, engine_tok: HFTokenizer, serve: Any
) -> None:
    engine = Scripted(engine_tok)
    endpoint = serve(engine)
    session = endpoint.open_session(seed=3)
    messages, (first, second) = converse(endpoint, session.key, "what is 2+3?")

    assert first["object"] == "chat.completion" and first["model"] == "policy"
    assert first["id"].startswith("chatcmpl-") and isinstance(first["created"], int)
    assert first["choices"] == [{
        "index": 0, "finish_reason": "tool_calls", "logprobs": None,
        "message": {"role": "assistant", "content": "Let me compute.", "tool_calls": [{
            "id": "call_1_0", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
    }]  # fmt: skip
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 5."}
    assert second["choices"][0]["finish_reason"] == "stop"
    gen1, gen2 = engine.ids_of("what is 2+3?", 0), engine.ids_of("what is 2+3?", 1)
    assert first["usage"] == {"prompt_tokens": len(engine.calls[0][0]), "completion_tokens": len(gen1),
                              "total_tokens": len(engine.calls[0][0]) + len(gen1)}  # fmt: skip
    # the run's sampling (no temperature in the requests), the session's seeds, one per call
    assert [c[1:] for c in engine.calls] == [(256, 0.7, 0.9, 3 * 1009 + 1), (256, 0.7, 0.9, 3 * 1009 + 2)]

    episode = endpoint.close_session(session)
    assert episode.token_exact and episode.breaks == []
    (segment,) = episode.segments
    prompt = template_ids(tok, messages[:1], generation_prompt=True)
    assert segment.prompt_ids == prompt == engine.calls[0][0]
    assert [t.ids for t in segment.turns] == [gen1, gen2]
    assert segment.turns[0].logprobs == pytest.approx([-0.01 * (k + 1) for k in range(len(gen1))])
    whole = template_ids(tok, [*messages, second["choices"][0]["message"]], generation_prompt=False)
    closing = tok.encode("\n", bos=False)  # what the template writes after the last <|im_end|>
    assert segment.prompt_ids + segment.ids() == whole[: -len(closing)] and whole[-len(closing) :] == closing
    obs = tok.hf.decode(segment.turns[0].observation)
    assert obs == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert segment.turns[1].observation == [] and segment.calls == [1, 2]
    assert post(endpoint, {"messages": messages}, session.key)[0] == 401  # closed: its key is refused


def test_strangers_and_wrong_keys_are_refused_and_not_recorded(
    tok: HFTokenizer, engine_tok: HFTokenizer, serve: Any
) -> None:
    engine = Scripted(engine_tok)
    endpoint = serve(engine)
    session = endpoint.open_session(seed=0)
    body = {"messages": [{"role": "user", "content": "what is 2+3?"}]}
    for key in (None, "wrong", session.key + "0", session.key[:-1]):
        status, reply = post(endpoint, body, key)
        assert status == 401, key
        assert reply == {"error": {"message": "missing or wrong API key", "type": "authentication_error",
                                   "param": None, "code": "invalid_api_key"}}  # fmt: skip
    assert post(endpoint, None, None, "/v1/models")[0] == 401
    assert engine.calls == [] and session.calls() == []
    assert post(endpoint, None, session.key, "/v1/models") == (
        200, {"object": "list", "data": [{"id": "policy", "object": "model", "created": endpoint.created,
                                          "owned_by": "megarl"}]})  # fmt: skip


def test_bad_requests_get_openai_errors_and_are_not_recorded(
    tok: HFTokenizer, engine_tok: HFTokenizer, serve: Any
) -> None:
    engine = Scripted(engine_tok)
    endpoint = serve(engine, max_body_bytes=4096, max_context=40)
    key = endpoint.open_session(seed=0).key
    user = [{"role": "user", "content": "what is 2+3?"}]
    cases = [
        (b"{not json", 400, None),
        (b'{"messages": ' + b" " * 5000 + b"[]}", 413, None),
        ({"messages": user, "n": 2}, 400, "n"),
        ({"messages": user, "stream": True}, 400, "stream"),
        ({"messages": user, "temperature": 3}, 400, "temperature"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [*user, {"role": "tool", "content": "5"}]}, 400, "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": "what is 2+3? " * 20}]}, 400, "messages"),  # > max_context
    ]
    for body, status, param in cases:
        got, reply = post(endpoint, body, key)
        assert got == status, (body, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["param"] == param
    assert post(endpoint, user, key, "/v1/completions")[0] == 404
    assert engine.calls == []


def test_two_concurrent_sessions_do_not_mix(tok: HFTokenizer, engine_tok: HFTokenizer, serve: Any) -> None:
    engine = Scripted(engine_tok, threading.Barrier(2))
    endpoint = serve(engine)
    questions = ["what is 2+3?", "what is 7*6?"]
    sessions = [endpoint.open_session(seed=s) for s in (1, 2)]
    out: dict[int, Any] = {}

    def agent(i: int) -> None:
        out[i] = converse(endpoint, sessions[i].key, questions[i])

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(out) == [0, 1]
    for i, (session, question) in enumerate(zip(sessions, questions, strict=True)):
        messages, replies = out[i]
        assert replies[1]["choices"][0]["message"]["content"] == SCRIPT[question][1]
        (segment,) = endpoint.close_session(session).segments
        assert segment.prompt_ids == template_ids(tok, messages[:1], generation_prompt=True)
        assert [t.ids for t in segment.turns] == [engine.ids_of(question, 0), engine.ids_of(question, 1)]
        assert questions[1 - i] not in tok.hf.decode(segment.prompt_ids + segment.ids())
        assert [c.seed for c in session.calls()] == [session.seed * 1009 + 1, session.seed * 1009 + 2]


def test_a_history_rewrite_starts_a_new_segment(tok: HFTokenizer, serve: Any) -> None:
    endpoint = serve()
    session = endpoint.open_session(seed=0)
    messages, _ = converse(endpoint, session.key, "what is 2+3?")
    messages[1]["content"] = "Computing."  # the agent edits what the model said, then goes on
    status, _ = post(endpoint, {"messages": messages, "tools": [CALCULATOR]}, session.key)
    assert status == 200
    episode = endpoint.close_session(session)
    assert not episode.token_exact and [s.calls for s in episode.segments] == [[1, 2], [3]]
    (why,) = episode.breaks
    first_prompt = len(episode.segments[0].prompt_ids)
    assert why.startswith(f"call 3: its prompt differs from call 2's prompt and completion at id {first_prompt} ")
    assert episode.segments[1].prompt_ids == template_ids(tok, messages, generation_prompt=True)


def test_stop_strings_limits_and_sampling(tok: HFTokenizer, engine_tok: HFTokenizer, serve: Any) -> None:
    engine = Scripted(engine_tok)
    endpoint = serve(engine)
    session = endpoint.open_session(seed=0)
    user = [{"role": "user", "content": "what is 2+3?"}]
    status, reply = post(endpoint, {"messages": user, "stop": ["compute"], "max_tokens": 500}, session.key)
    assert status == 200 and reply["choices"][0]["message"] == {"role": "assistant", "content": "Let me "}
    (call,) = session.calls()
    full = engine.ids_of("what is 2+3?", 0)
    assert engine.calls[0][1] == 256  # the endpoint's cap, not the agent's 500
    assert call.ids == full[: len(call.ids)] and "compute" in tok.hf.decode(call.ids)
    assert "compute" not in tok.hf.decode(call.ids[:-1]) and len(call.logprobs) == len(call.ids)
    body = {"messages": user, "max_tokens": 3, "tool_choice": "none", "temperature": 0.2, "top_p": 0.5}
    status, reply = post(endpoint, body, session.key)
    assert (
        status == 200 and reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "length"
    )
    assert engine.calls[1][1:4] == (3, 0.7, 0.9)  # the run's sampling: the agent's is not the trained policy's
    assert session.calls()[1].finish_reason == "length" and session.episode().segments[1].turns[0].truncated
    free = serve(engine, pin_sampling=False)
    assert post(free, body, free.open_session(seed=0).key)[0] == 200 and engine.calls[2][1:4] == (3, 0.2, 0.5)


def test_env_agent_runs_user_code_through_the_openai_client(
    engine_tok: HFTokenizer, serve: Any, tmp_path: Path
) -> None:
    pytest.importorskip("openai")
    agent_file = tmp_path / "my_agent.py"
    agent_file.write_text(
        textwrap.dedent("""
        import json
        from megarl.rewards.tool_env import CALCULATOR, calculator

        def solve(client, row):
            messages = [{"role": "user", "content": row["prompt"]}]
            while True:
                reply = client.chat.completions.create(model="x", messages=messages, tools=[CALCULATOR])
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return float(message.content.endswith(row["answer"] + "."))
                for call in message.tool_calls:
                    result = calculator(json.loads(call.function.arguments))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

        async def solve_async(client, row):
            messages = [{"role": "user", "content": row["prompt"]}]
            reply = await client.chat.completions.create(model="x", messages=messages, tools=[CALCULATOR])
            return float(reply.choices[0].message.tool_calls[0].function.name == "calculator")
    """)
    )
    engine = Scripted(engine_tok)
    endpoint = serve(engine)
    row = {"prompt": "what is 2+3?", "answer": "5"}
    result = run_agent(endpoint, import_agent(f"{agent_file}:solve"), row, seed=7, failed_reward=-1.0)
    assert (result.reward, result.error) == (1.0, "")
    assert result.episode.token_exact and [len(s.turns) for s in result.episode.segments] == [2]
    turns = result.episode.segments[0].turns
    assert [t.ids for t in turns] == [engine.ids_of("what is 2+3?", 0), engine.ids_of("what is 2+3?", 1)]
    assert [c[4] for c in engine.calls] == [7 * 1009 + 1, 7 * 1009 + 2]
    result = run_agent(endpoint, import_agent(f"{agent_file}:solve_async"), row, seed=9, failed_reward=-1.0)
    assert (result.reward, result.error, len(result.episode.segments[0].turns)) == (1.0, "", 1)
    failed = run_agent(endpoint, lambda client, row: "yes", {"prompt": "what is 2+3?"}, seed=8, failed_reward=-1.0)
    assert failed.reward == -1.0 and "not a finite number" in failed.error
    bad = tmp_path / "bad_agent.py"
    bad.write_text("def solve():\n    return 1.0\n")
    with pytest.raises(EnvSpecError, match=r"solve\(\) cannot be called as solve\(client, row\)"):
        import_agent(f"{bad}:solve")
    with pytest.raises(ConfigError, match="env.agent='a:b' and env.fn='calculator' are alternatives"):
        EnvConfig(agent="a:b", fn="calculator").validate()
