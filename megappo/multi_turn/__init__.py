"""Multi-turn rollouts with tool calls: the tool interface and its config (`tools.py`), the built-in sandboxed
Python tool, and the token-in-token-out conversation loop over a rollout engine."""
