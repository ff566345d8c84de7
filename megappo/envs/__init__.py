"""Environments and the episode loop that runs them over a rollout engine (see megappo/envs/base.py)."""
