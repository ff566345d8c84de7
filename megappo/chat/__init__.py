"""The chat pieces every episode shares: the chat template's tokens around an environment's messages (`ChatDelta`),
untrusted text escaped so it never becomes a control token (`ToolText`), and the tool-call parsers of an assistant
turn (`parser.py`, hermes). Imports nothing else of megappo: the episode loop, the tool loop, the agent endpoint and
the judge all build on it."""
