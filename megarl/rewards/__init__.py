"""Rewards: the built-ins (``builtin``), the user's rewards as ``reward.fn`` names them,
resolved and checked before launch (``specs``) and scored (``runner``), and the worker
processes that isolate them (``pool``: timeouts, crashes, leaks). Environments for
multi-turn episodes will live here.
"""
