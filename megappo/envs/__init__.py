"""The base of episodes: the environment interface (`base.py`), the episode loop over a rollout engine (`loop.py`,
`engine.py`), its failures and metrics, the agent loops by name (`registry.py`) and the built-in environments. The
tool loop (`megappo.multi_turn`) and agent programs (`megappo.agents`) are plug-ins above it."""
