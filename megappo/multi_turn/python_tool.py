"""The built-in Python tool: runs the model's code in the sandbox (`megappo.sandbox`) and answers with its output.

In a tool config file (recipes/tools/python_tool.yaml):

    tools:
      - class_name: megappo.multi_turn.python_tool.PythonTool
        config: {timeout_s: 5, memory_mb: 1024}
        tool_schema:
          type: function
          function:
            name: code_interpreter
            description: Runs Python code and returns what it prints.
            parameters: {type: object, properties: {code: {type: string}}, required: [code]}

Config keys (all optional): timeout_s (wall time per call), cpu_s, memory_mb (the call's memory in all: its
memory cgroup; also each process's address space), max_processes, max_file_mb, disk_mb (the call's tmpfs),
max_open_files, max_output_chars (the answer's length; the middle is cut, verl's "middle" side), truncate_side
(left/right/middle), max_output_bytes (output past which the code is stopped), readable_paths (files or
directories of the machine the code may read, bound read-only at their paths; none by default),
allow_network_unsandboxed, allow_filesystem_unsandboxed, allow_syscalls_unfiltered (run where the machine cannot
isolate the code: see docs/agents-and-environments.md). hidden_paths is accepted and ignored (the sandbox shows
an allow-list, so nothing needs hiding). verl's SandboxFusion keys port:
default_timeout and memory_limit_mb are timeout_s and memory_mb; default_language must be python; the service's
own (sandbox_fusion_url, num_workers, rate_limit, enable_global_rate_limit, type) are ignored with a warning.

The answer is the code's stdout, then its stderr under a "stderr:" line, and a last line saying why it ended where
it did not end by itself (the timeout, the CPU limit, the output cap, a signal, an exit code other than 0).
Metrics (means over calls, logged as tool/<name>/<key>): latency_s, timeout, error (the code failed: traceback,
exit code, a limit), sandbox_error (the sandbox itself failed), exit_code, output_truncated.

One sandbox (one zygote process) serves every instance and thread of the tool; it starts at the first call
(or `start()`), and `close()` ends it with every call in flight.
"""
from __future__ import annotations

import logging
import signal
from typing import Optional

from megappo.sandbox import Limits, RunResult, Sandbox, truncate
from megappo.multi_turn.tools import BaseTool, ToolResult

logger = logging.getLogger(__name__)
_LIMIT_KEYS = ("timeout_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb", "disk_mb", "max_open_files",
               "max_output_bytes")
_OTHER_KEYS = ("max_output_chars", "truncate_side", "allow_network_unsandboxed", "allow_filesystem_unsandboxed",
               "allow_syscalls_unfiltered", "readable_paths", "hidden_paths")


# verl's SandboxFusion tool config (recipe/retool/sandbox_fusion_tool_config.yaml), so its configs port as they are
_VERL_ALIASES = {"default_timeout": "timeout_s", "memory_limit_mb": "memory_mb"}
_VERL_IGNORED = ("sandbox_fusion_url", "num_workers", "rate_limit", "enable_global_rate_limit", "type")


class PythonTool(BaseTool):
    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        for verl_key, key in _VERL_ALIASES.items():
            if verl_key in self.config:
                if key in self.config:
                    raise ValueError(f"PythonTool config: both {key} and verl's {verl_key}; keep one")
                self.config[key] = self.config.pop(verl_key)
        ignored = [k for k in _VERL_IGNORED if k in self.config]
        if ignored:  # the remote SandboxFusion service's settings: this tool runs the code locally
            logger.warning("PythonTool: ignoring verl's SandboxFusion settings %s (the code runs in megappo's local "
                           "sandbox; ToolPool's max_workers bounds the calls at once)", ignored)
            for k in ignored:
                self.config.pop(k)
        if self.config.pop("hidden_paths", None) is not None:
            logger.warning("PythonTool: hidden_paths is ignored: the sandbox shows the code only the interpreter's "
                           "files and readable_paths")
        language = self.config.pop("default_language", "python")
        if language != "python":
            raise ValueError(f"PythonTool config: default_language {language!r}: this tool runs Python only")
        unknown = set(self.config) - set(_LIMIT_KEYS) - set(_OTHER_KEYS)
        if unknown:
            raise ValueError(f"PythonTool config: unknown keys {sorted(unknown)}; "
                             f"known: {sorted(_LIMIT_KEYS + _OTHER_KEYS)}")
        limits = Limits(**{k: self.config[k] for k in _LIMIT_KEYS if k in self.config})
        if "cpu_s" not in self.config:  # the wall timeout is the binding limit unless asked otherwise
            limits.cpu_s = max(1, int(limits.timeout_s) + 1)
        self.max_output_chars = int(self.config.get("max_output_chars", 4096))
        self.truncate_side = str(self.config.get("truncate_side", "middle"))
        truncate("", 1, self.truncate_side)  # a bad side fails here, not at the first call
        # keep enough of each stream for the answer's head and tail
        limits.keep_bytes = max(4 * self.max_output_chars, 4096) if self.max_output_chars > 0 else limits.keep_bytes
        self.limits = limits
        self.sandbox = Sandbox(limits,
                               allow_network_unsandboxed=bool(self.config.get("allow_network_unsandboxed", False)),
                               allow_filesystem_unsandboxed=bool(self.config.get("allow_filesystem_unsandboxed",
                                                                                 False)),
                               allow_syscalls_unfiltered=bool(self.config.get("allow_syscalls_unfiltered", False)),
                               readable_paths=list(self.config.get("readable_paths") or []))

    def start(self) -> "PythonTool":
        """Start the sandbox now (else at the first call): a machine that cannot isolate fails here, saying why."""
        self.sandbox.start()
        return self

    def execute(self, instance_id: str, arguments: dict) -> ToolResult:
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            got = sorted(arguments) if isinstance(arguments, dict) else type(arguments).__name__
            return ToolResult(text=f'Error: the call needs a string argument "code" with the Python code to run '
                                   f'(got {got}).', metrics={"error": 1.0, "timeout": 0.0, "sandbox_error": 0.0})
        res = self.sandbox.run(code)
        return ToolResult(text=self.answer(res), metrics=self._metrics(res))

    def answer(self, res: RunResult) -> str:
        """What the model reads: output, stderr, and why the code stopped."""
        if res.error:
            return f"Error: the sandbox failed to run the code ({res.error})."
        parts = [res.stdout]
        if res.stderr:
            parts.append(("\n" if res.stdout and not res.stdout.endswith("\n") else "") + "stderr:\n" + res.stderr)
        text = "".join(parts)
        if self.max_output_chars > 0:
            text = truncate(text, self.max_output_chars, self.truncate_side)
        note = self._why_stopped(res)
        if note:
            text = (text + ("\n" if text and not text.endswith("\n") else "") + note) if text else note
        return text if text else "(no output)"

    def _why_stopped(self, res: RunResult) -> Optional[str]:
        lim = self.limits
        if res.timed_out:
            return f"Error: timed out after {lim.timeout_s:g} s (the wall-time limit); the program was killed."
        if res.output_limited:
            total = res.stdout_bytes + res.stderr_bytes
            return (f"Error: output limit exceeded ({total} bytes written, limit {lim.max_output_bytes}); "
                    "the program was killed.")
        if res.memory_limited:
            return (f"Error: out of memory (limit {lim.memory_mb} MB for the whole program, its processes, files and "
                    "shared memory included); the program was killed.")
        if res.signal in (signal.SIGXCPU, signal.SIGKILL) and res.cpu_s >= lim.cpu_s - 0.05:
            return f"Error: CPU time limit exceeded ({lim.cpu_s} s); the program was killed."
        if res.signal is not None:
            return f"Error: the program was killed by signal {signal.Signals(res.signal).name}."
        if res.exit_code:
            if "MemoryError" in res.stderr:
                return f"Error: out of memory (limit {lim.memory_mb} MB); exit code {res.exit_code}."
            return f"Exit code {res.exit_code}."
        return None

    def _metrics(self, res: RunResult) -> dict[str, float]:
        failed = bool(res.error or res.timed_out or res.output_limited or res.signal is not None or res.exit_code)
        cut = self.max_output_chars > 0 and len(res.stdout) + len(res.stderr) > self.max_output_chars
        return {"latency_s": res.latency_s, "timeout": float(res.timed_out), "error": float(failed),
                "sandbox_error": float(bool(res.error)),
                "exit_code": float(res.exit_code if res.exit_code is not None else -(res.signal or 1)),
                "memory_limited": float(res.memory_limited),
                "output_truncated": float(cut or res.output_limited
                                          or res.stdout_bytes + res.stderr_bytes > len(res.stdout) + len(res.stderr))}

    def close(self) -> None:
        self.sandbox.close()

    def __del__(self):
        try:
            self.sandbox.close()
        except Exception:
            pass
