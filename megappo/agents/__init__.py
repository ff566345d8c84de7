"""Agents as programs: an OpenAI-compatible chat-completions endpoint in front of the rollout engine, so that a
user's agent runs unchanged against megappo while every call's exact tokens are recorded per trajectory.

`endpoint.py` (`AgentEndpoint`: keys, requests, recording), its parts `http.py` (the HTTP layer and its limits),
`conversation.py` (messages to token ids: segments continued or started anew, untrusted text escaped),
`openai_format.py` (the wire format, tool calls, streaming), `batcher.py` (concurrent calls batched into engine
requests) and `records.py` (what is kept per trajectory); `stitch.py` (a trajectory's last segment as a training
sample); `runner.py` (`AgentRunner`: the user's agent function per sample, with deadlines)."""
