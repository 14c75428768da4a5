"""Rewards: the built-ins (``builtin``), the user's rewards as ``reward.fn`` names them,
resolved and checked before launch (``specs``) and scored (``runner``), and the worker
processes that isolate them (``pool``: timeouts, crashes, leaks). Environments for multi-turn
episodes: the interface (``env``), ``env.fn`` resolved (``env_spec``), the built-in tool
environments (``tool_env``: ``calculator``, and ``python`` in its sandbox, ``python_tool``), tool
calls read from a turn (``tool_calls``); existing agent code through an OpenAI-compatible
endpoint (``agent``, ``agent_endpoint``, ``agent_session``, ``agent_wire``).
"""
