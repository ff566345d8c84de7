"""A chat-completions request's messages as token ids, continuing a trajectory's segment when they can.

Every message content the client sends is untrusted text (an agent program relays what tools, users and
environments wrote): it is escaped and tokenised alone (`ToolText`, megappo/chat/template.py), never as the
template's control tokens, by rendering the template with a placeholder in each content ("slots"). The assistant
turns the endpoint answered are never re-tokenised: the client's copy of such a message is matched to the recorded
turn (its content and the tool-call ids the endpoint issued), and the segment's recorded ids stand for it.

Continuation: the request's messages must be the segment's first messages, then each answered turn with the
messages recorded after it, then new non-assistant messages (the tail). The template renders that conversation
(the turns as the model's own text); the decode of the segment's ids must be a prefix of the rendering, and the
rest of the rendering (closing the last turn, the tail, the generation prompt) is tokenised and appended. Anything
else starts a new segment from the whole rendering (`Plan.continued` False).
"""
from __future__ import annotations

import functools
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megappo.agents.records import Segment, Turn
from megappo.chat.parser import MARKUP
from megappo.chat.template import ToolText

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(ValueError):
    """A request the endpoint refuses (HTTP 400, the message says why)."""


def _text(content: Any, where: str) -> str:
    """A message content (a string, null, or OpenAI's list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string, null or a list of text parts")


def _tool_calls(raw: Any, where: str) -> tuple[tuple[str, str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequest(f"{where}: tool_calls must be a list")
    out = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}: each tool call needs function.name")
        args = fn.get("arguments", "{}")
        out.append((str(call.get("id", "")), fn["name"], args if isinstance(args, str) else json.dumps(args)))
    return tuple(out)


def canonical(messages: Any, max_messages: int) -> list[dict]:
    """The request's messages as plain dicts {role, content (str), tool_calls (tuple), tool_call_id, name}; the
    fields the template does not read (refusal, annotations, ...) are dropped."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    if len(messages) > max_messages:
        raise BadRequest(f"{len(messages)} messages; at most {max_messages} per request")
    out = []
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where}: needs a role, one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _text(m.get("content"), where)}
        if m["role"] == "assistant":
            msg["tool_calls"] = _tool_calls(m.get("tool_calls"), where)
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def matches(message: dict, turn: Turn) -> bool:
    """Whether the client's assistant message is the turn the endpoint answered (sent back unchanged)."""
    if message["content"].strip() != turn.content.strip() or len(message["tool_calls"]) != len(turn.tool_calls):
        return False
    for (cid, name, args), (tid, tname, targs) in zip(message["tool_calls"], turn.tool_calls):
        if cid != tid or name != tname:
            return False
        if args != targs:
            try:
                if json.loads(args) != json.loads(targs):
                    return False
            except ValueError:
                return False
    return True


@dataclass
class Plan:
    """How a call's prompt is made: the segment continued (`delta` appended to its ids) or a new one."""

    continued: bool
    prompt_ids: list[int]  # the whole prompt
    delta: list[int]  # continued: the ids appended to the segment before the model's turn; new: the whole prompt
    base: list[dict]  # new: the segment's first messages
    tail: list[dict]  # continued: the messages after the last turn (recorded as `between`)


def _locked(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class PromptBuilder:
    """Renders requests with one tokenizer's chat template (see the module docstring).

    Every call into the tokenizer (encoding, decoding; not the template's rendering) holds `lock`: a fast tokenizer's escaped encoding (`split_special_tokens`) switches
    the shared Rust tokenizer's special-token matching off and on, so a concurrent encoding of template text could
    lose its control tokens (and a concurrent borrow raises "Already borrowed")."""

    def __init__(self, tokenizer, markup: Sequence[str] = MARKUP["hermes"]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the agent endpoint needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.lock = threading.RLock()
        self.tool_text = ToolText(tokenizer, markup)
        self._nonce = uuid.uuid4().hex
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if eos is not None else set()
        # a fast tokenizer's Rust tokenizer, called directly: what `encode`/`decode` do for it, a third of the cost
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) \
            else None

    # -- text -------------------------------------------------------------------------------------------------------
    @_locked
    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def turn_text(self, output_ids: Sequence[int]) -> str:
        """An assistant turn's text as the template renders it: its tokens decoded, a closing EOS left out."""
        ids = list(output_ids)
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def escape_all(self, x: Any) -> Any:
        """`x` (JSON data) with every string in it escaped: what the template renders as its own text."""
        if isinstance(x, str):
            return self.tool_text.escape(x)
        if isinstance(x, list):
            return [self.escape_all(v) for v in x]
        if isinstance(x, dict):
            return {self.escape_all(k): self.escape_all(v) for k, v in x.items()}
        return x

    def escape_tools(self, tools: Any) -> Optional[list]:
        """The request's tool schemas, every string escaped (the template renders them as its own text)."""
        if tools is None:
            return None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools must be a list of objects")
        try:
            return self.escape_all(tools) or None
        except RecursionError:
            raise BadRequest("tools nest too deeply") from None

    def _slot(self, k: int) -> str:
        return f"\ue000{self._nonce}:{k}\ue001"

    def _render(self, messages: list[dict], tools: Optional[list]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # a template that raises on these messages (jinja's raise_exception, say)
            raise BadRequest(f"the chat template cannot render these messages: {e}") from None

    def _template_message(self, m: dict, content: str) -> dict:
        """The message as the template gets it: `content` (a slot or escaped text), and every other string the
        template may render (name, tool_call_id, a tool call's name and arguments) escaped."""
        out = {"role": m["role"], "content": content}
        for key in ("tool_call_id", "name"):
            if key in m:
                out[key] = self.tool_text.escape(m[key])
        if m.get("tool_calls"):
            out["tool_calls"] = self.escape_all([{"id": i, "type": "function",
                                                  "function": {"name": n, "arguments": _args(a)}}
                                                 for i, n, a in m["tool_calls"]])
        return out

    def _encode_slots(self, text: str, contents: list[str]) -> list[int]:
        pieces, rest = [], text
        for k in range(len(contents)):
            piece, found, rest = rest.partition(self._slot(k))
            if not found or self._slot(k) in rest:
                raise _NotVerbatim()
            pieces.append(piece)
        pieces.append(rest)
        template, untrusted = self._encode_many(pieces), self._encode_untrusted(contents)
        return [i for k, ids in enumerate(untrusted) for i in template[k] + ids] + template[-1]

    @_locked
    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        if self._backend is None:
            return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    @_locked
    def _encode_untrusted(self, texts: list[str]) -> list[list[int]]:
        """Each text escaped and tokenised with special-token matching off (`ToolText.encode`)."""
        if self._backend is None or not texts:
            return [self.tool_text.encode(t) for t in texts]
        before = self._backend.encode_special_tokens
        self._backend.encode_special_tokens = True
        try:
            out = [e.ids for e in self._backend.encode_batch([self.tool_text.escape(t) for t in texts],
                                                             add_special_tokens=False)]
        finally:
            self._backend.encode_special_tokens = before
        bad = self.tool_text.control_ids.intersection(i for ids in out for i in ids)
        if bad:  # as ToolText.encode: refuse rather than show the model a control token from untrusted text
            raise BadRequest(f"a message tokenises to control token(s) {sorted(bad)} even escaped")
        return out

    @_locked
    def encode(self, text: str) -> list[int]:
        """The template's own text (its control tokens are real)."""
        return self._encode_many([text])[0]

    # -- plans ------------------------------------------------------------------------------------------------------
    def fresh(self, messages: list[dict], tools: Optional[list]) -> Plan:
        """A new segment: the whole rendering, each content escaped and tokenised alone."""
        shown = [self._template_message(m, self._slot(k)) for k, m in enumerate(messages)]
        contents = [m["content"] for m in messages]
        try:
            ids = self._encode_slots(self._render(shown, tools), contents)
        except _NotVerbatim:  # the template transforms contents: tokenise its rendering of the escaped contents
            escaped = [self._template_message(m, self.tool_text.escape(m["content"])) for m in messages]
            ids = self._encode_many([self._render(escaped, tools)])[0]
        return Plan(False, ids, ids, messages, [])

    def continuation(self, segment: Segment, messages: list[dict], tools: Optional[list]) -> Optional[Plan]:
        """The segment continued by these messages, or None when they are another history."""
        tail = _tail(segment, messages)
        if tail is None:
            return None
        shown = [self._template_message(m, self.tool_text.escape(m["content"])) for m in segment.base]
        for i, turn in enumerate(segment.turns):
            shown.append({"role": "assistant", "content": turn.text})
            if i < len(segment.between):
                shown += [self._template_message(m, self.tool_text.escape(m["content"])) for m in segment.between[i]]
        shown += [self._template_message(m, self._slot(k)) for k, m in enumerate(tail)]
        rendered, recorded = self._render(shown, tools), self.decode(segment.ids)
        if not rendered.startswith(recorded):
            return None
        try:
            delta = self._encode_slots(rendered[len(recorded):], [m["content"] for m in tail])
        except _NotVerbatim:
            return None
        return Plan(True, segment.ids + delta, delta, [], tail)


class _NotVerbatim(Exception):
    """The template does not render each slot once and verbatim."""


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _tail(segment: Segment, messages: list[dict]) -> Optional[list[dict]]:
    """The messages after the segment's last turn, when `messages` are the segment's history; else None."""
    n = len(segment.base)
    if not segment.turns or messages[:n] != segment.base:
        return None
    pos = n
    for i, turn in enumerate(segment.turns):
        if pos >= len(messages) or messages[pos]["role"] != "assistant" or not matches(messages[pos], turn):
            return None
        pos += 1
        if i < len(segment.turns) - 1:
            between = segment.between[i]
            if messages[pos:pos + len(between)] != between:
                return None
            pos += len(between)
    tail = messages[pos:]
    if any(m["role"] == "assistant" for m in tail):  # an assistant message the endpoint never answered
        return None
    return tail
