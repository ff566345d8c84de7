"""An agent program with real tool calls on the `openai` client, for the tool_sum task
(recipes/cpu/tiny_openai_tool_agent_ppo.yaml): the agent offers the model a calculator (`tools=[...]`), runs each
tool call the endpoint returns (`message.tool_calls`) itself, sends the results back as "tool" messages, and scores
the final answer. megappo parses the model's hermes calls into OpenAI tool calls and renders the tool messages with
the model's chat template; the agent never sees a token.

The calculator is the agent's own code (a tool is whatever the agent runs): here the safe evaluator of the built-in
tool loop's calculator (megappo/multi_turn/calculator.py). A call whose arguments are not an expression gets its
error as the tool's answer, as a tool server would send it. The episode's own metrics (calculator calls and errors)
show as env/calculator_calls and env/calculator_errors.
"""
from __future__ import annotations

import json

import openai

from megappo.multi_turn.calculator import evaluate

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def run_tool(call) -> str:
    """A tool call's answer: the calculator's result, or the error the model should read."""
    if call.function.name != "calculator":
        return f"error: no tool named {call.function.name!r}"
    try:
        expression = json.loads(call.function.arguments)["expression"]
        return str(evaluate(str(expression)))
    except Exception as e:  # the model's arguments are untrusted: any failure is the call's answer, not a crash
        return f"error: {e}"


def solve(base_url: str, api_key: str, row, max_turns: int = 3) -> dict:
    """One episode: up to `max_turns` assistant turns; each turn's tool calls run here and their answers go back.
    Returns the reward (1.0 when the final answer is exactly the sum) and the episode's own metrics (env/<key>)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = list(row.prompt)
    calls = errors = 0
    try:
        for _ in range(max_turns):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                   max_tokens=32)
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = (message.content or "").strip()
                break
            messages.append(message.model_dump(exclude_none=True))  # the assistant turn, with its tool_calls
            for call in message.tool_calls:
                result = run_tool(call)
                calls += 1
                errors += result.startswith("error:")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        else:
            answer = ""  # out of turns without an answer
    finally:
        client.close()
    return {"reward": float(answer == str(row.ground_truth)),
            "metrics": {"calculator_calls": float(calls), "calculator_errors": float(errors)}}
