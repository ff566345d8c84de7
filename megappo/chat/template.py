"""The chat template's tokens around tool answers (`ChatDelta`), and a tool's text made safe to show the model
(`ToolText`).

A tool's answer is untrusted text: a program can print `<|im_end|>\\n<|im_start|>assistant\\n` or
`</tool_response>`. Tokenised as the template's own text is, that would become the tokenizer's control tokens and
fake the end of the tool turn and a new turn of another role. So a tool's text never goes through the template's
tokenisation: the template is rendered with a placeholder in each tool message, its own text is tokenised as
usual (its control tokens are real), and each tool text is escaped and tokenised alone, without special-token
matching. Every answer's tokens hold no special token and no markup token, and the turn has exactly the template's
`<tool_response>` ... `</tool_response>` per answer.

Escaping: each control string in the text (every special token of the tokenizer, every added token that looks like
markup, `<...>`, and the format's tags) is written with its `<` as `&lt;` (HTML's escape, which models read), or
with a backslash after its first character where it has no `<`. The model reads `&lt;|im_end|>`; the trajectory's
messages hold the escaped text, which is what the strict template check compares.
"""
from __future__ import annotations

import re
import uuid
from typing import Optional, Sequence

from megappo.chat.parser import MARKUP

_STUB_USER = [{"role": "user", "content": "?"}]  # the conversation a delta is rendered after (templates are local)


def _neutral(control: str) -> str:
    return "&lt;" + control[1:] if control.startswith("<") else control[:1] + "\\" + control[1:]


def _looks_like_markup(text: str) -> bool:
    return len(text) >= 3 and text.startswith("<") and text.endswith(">")


class ToolText:
    """Escaping and tokenising of tool text for one tokenizer: `encode(text)` never holds a control token id."""

    def __init__(self, tokenizer, markup: Sequence[str] = MARKUP["hermes"]):
        self.tokenizer = tokenizer
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        controls = set(markup) | set(tokenizer.all_special_tokens)
        controls |= {t.content for t in added.values() if t.special or _looks_like_markup(t.content)}
        self.controls = sorted((c for c in controls if c), key=len, reverse=True)  # longest match first
        self.control_ids = {i for i, t in added.items() if t.content in controls} | set(tokenizer.all_special_ids)
        self._pattern = re.compile("|".join(map(re.escape, self.controls)))

    def escape(self, text: str) -> str:
        """`text` with no control string in it; text without one is unchanged (so escaping twice is escaping
        once)."""
        for _ in range(len(self.controls) + 1):  # an escape could complete another control string: repeat
            out = self._pattern.sub(lambda m: _neutral(m.group(0)), text)
            if out == text:
                return out
            text = out
        raise RuntimeError("tool text: escaping its control strings does not converge")

    def encode(self, text: str) -> list[int]:
        """The escaped text's token ids, special-token matching off."""
        ids = self.tokenizer.encode(self.escape(text), add_special_tokens=False, split_special_tokens=True)
        bad = self.control_ids.intersection(ids)
        if bad:  # a tokenizer whose plain text tokenises to a control id: refuse rather than train on it
            raise RuntimeError(f"tool text tokenises to control token(s) {sorted(bad)} even escaped "
                               f"({type(self.tokenizer).__name__})")
        return ids


def template_tools_problem(tokenizer, schemas: Optional[list[dict]]) -> Optional[str]:
    """Why the chat template does not show the model its tools (None: it does, or there are none): rendered with
    and without `tools=`, a template that ignores them gives the same text."""
    if not schemas:
        return None
    if not getattr(tokenizer, "chat_template", None):
        return "the tokenizer has no chat template, so the model is never shown its tools and tool answers"

    def render(tools):
        return tokenizer.apply_chat_template(_STUB_USER, tools=tools, tokenize=False, add_generation_prompt=True)

    with_tools = render(schemas)
    same = with_tools == render(None)
    missing = [s["function"]["name"] for s in schemas if s["function"]["name"] not in with_tools]
    if not same and not missing:
        return None
    what = "ignores tools= (the same text with and without the tool schemas)" if same \
        else f"does not name the tools {missing} when given tools="
    source = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return (f"the chat template of the tokenizer ({source}) {what}, so the model never sees the tools it is to "
            "call. Use a model whose chat template renders tools (e.g. Qwen2.5/Qwen3 instruct, hermes format), or "
            "point data.tokenizer / actor_rollout_ref.model.tokenizer_path at a tokenizer whose template does")


class TemplateIgnoresTools(ValueError):
    """The chat template does not show the model its tools (`template_tools_problem`)."""


class ChatDelta:
    """The chat template's tokens around tool answers, given the tokenizer (its chat template) and the tools'
    schemas (the template's `tools=`)."""

    def __init__(self, tokenizer, tool_schemas: list[dict], markup: Sequence[str] = MARKUP["hermes"]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template (it renders the tool answers)")
        problem = template_tools_problem(tokenizer, tool_schemas)
        if problem:
            raise TemplateIgnoresTools(problem)
        self.tokenizer, self.schemas = tokenizer, tool_schemas or None
        self.tool_text = ToolText(tokenizer, markup)
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}
        self._nonce = uuid.uuid4().hex
        self._head = self._render(_STUB_USER, True)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _slot(self, k: int) -> str:
        """A tool message's placeholder: private-use characters no answer holds (answers go in by token ids)."""
        return f"\ue000{self._nonce}:{k}\ue001"

    def escape(self, text: str) -> str:
        return self.tool_text.escape(text)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """An episode's first messages (an environment's own prompt) as the template renders them for generation."""
        return self.encode(self._render(messages, True))

    def encode(self, text: str) -> list[int]:
        """The template's own text (its control tokens are real)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def content(self, turn_ids: Sequence[int]) -> str:
        """An assistant turn's message content: its text without a closing EOS."""
        ids = list(turn_ids)
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def _encode_slots(self, text: str, contents: Sequence[str]) -> list[int]:
        """`text` (a rendering with placeholders) as token ids: the template's pieces as the template's text, each
        placeholder as its tool text."""
        ids, rest = [], text
        for k, content in enumerate(contents):
            piece, found, rest = rest.partition(self._slot(k))
            if not found or self._slot(k) in rest:
                raise RuntimeError("the chat template does not render a tool message's content once and verbatim, "
                                   "so tool answers cannot be appended token-in-token-out")
            ids += self.encode(piece) + self.tool_text.encode(content)
        return ids + self.encode(rest)

    def tool_answer(self, turn_ids: Sequence[int], answers: list[str]) -> list[int]:
        """The tokens after an assistant turn that called tools: `after_turn` with one tool message per answer."""
        return self.after_turn(turn_ids, [{"role": "tool", "content": a} for a in answers])

    def after_turn(self, turn_ids: Sequence[int], messages: list[dict]) -> list[int]:
        """The tokens the template puts after an assistant turn (`turn_ids`, as generated) and before the next
        assistant turn's text: the turn's closing, `messages` (tool or user messages from an environment: untrusted,
        each content escaped and tokenised alone) and the next generation prompt."""
        before = self._head + self.decode(turn_ids)
        shown = [{**m, "content": self._slot(k)} for k, m in enumerate(messages)]
        after = self._render(_STUB_USER + [{"role": "assistant", "content": self.content(turn_ids)}] + shown, True)
        if not after.startswith(before):
            raise RuntimeError("the chat template renders an assistant turn differently from the generated text, so "
                               "tool answers cannot be appended token-in-token-out; the template must render an "
                               "assistant message's content verbatim")
        return self._encode_slots(after[len(before):], [m["content"] for m in messages])

    def expected_response(self, messages: list[dict]) -> list[int]:
        """The template's tokens of a trajectory's turns (`messages` after the prompt) as one rendering, the
        environment's (tool, user) messages tokenised as `after_turn` does."""
        contents: list[str] = []
        shown = []
        for m in messages:
            if m.get("role") != "assistant":  # an environment's message: tokenised as `after_turn` does
                shown.append({**m, "content": self._slot(len(contents))})
                contents.append(m["content"])
            else:
                shown.append(m)
        return self._encode_slots(self._render(_STUB_USER + shown, False)[len(self._head):], contents)
