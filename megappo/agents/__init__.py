"""Agents as programs: an OpenAI-compatible endpoint in front of the rollout engine (`endpoint.py`), which records
every call's exact tokens per trajectory, the stitching of a trajectory's calls into one training sample
(`stitch.py`), and the runner of a user's agent function per sample (`runner.py`)."""
