"""Judge prompts: a built-in template by name, or the user's own string with {question}, {response} and optionally
{ground_truth} (pairwise: {response_a} and {response_b}), filled per sample and, when the judge's tokenizer has a
chat template, wrapped in it as one user message."""
from __future__ import annotations

import re
import uuid
from typing import Any, Optional, Sequence

_NONCE = uuid.uuid4().hex[:12]
_SLOTS = re.compile(f"\ue000{_NONCE}:(\\d+)\ue001")
TEMPLATES: dict[str, str] = {
    # a yes/no verdict on one response (parser=yes_no)
    "default": ("Question:\n{question}\n\nReference answer:\n{ground_truth}\n\nResponse:\n{response}\n\n"
                "Is the response's final answer correct? Answer with one word, yes or no."),
    # a score on a scale (parser=number with number_min=0, number_max=10)
    "score": ("Question:\n{question}\n\nReference answer:\n{ground_truth}\n\nResponse:\n{response}\n\n"
              "Rate the response from 0 (wrong) to 10 (correct and well argued). End with the number alone."),
    # the built-in digit_max judge (megappo/tasks/digit_judge.py): "max 3 9 1 4 = 9 ?" -> yes | no
    "digit_max": "{question} {response} ?",
    # which of two responses is better (parser=pairwise)
    "pairwise": ("Question:\n{question}\n\nResponse A:\n{response_a}\n\nResponse B:\n{response_b}\n\n"
                 "Which response answers the question better? Answer with one letter, A or B."),
}


def template_text(name_or_text: str) -> str:
    """A built-in template's text, or the argument itself (the user's template)."""
    return TEMPLATES.get(name_or_text, name_or_text)


def fill(template: str, question: str, response: str, ground_truth: Any = None) -> str:
    """The judge prompt for one response (its surrounding whitespace dropped: no verdict should depend on it)."""
    return template.format_map({"question": question, "response": response.strip(),
                                "ground_truth": "" if ground_truth is None else str(ground_truth)})


def fill_pair(template: str, question: str, a: str, b: str, ground_truth: Any = None) -> str:
    """The judge prompt comparing responses `a` and `b`."""
    return template.format_map({"question": question, "response_a": a.strip(), "response_b": b.strip(),
                                "ground_truth": "" if ground_truth is None else str(ground_truth)})


def slot(k: int) -> str:
    """Where the `k`th untrusted part (a response) goes in a filled template: private-use characters and a nonce no
    text holds; `token_ids` puts the part's own tokens there."""
    return f"\ue000{_NONCE}:{k}\ue001"


def token_ids(tokenizer: Any, text: str, use_chat_template: bool, untrusted: Sequence[str] = (),
              guard: Any = None) -> list[int]:
    """The judge's prompt tokens: `text` as one user message of its chat template (when it has one and
    `use_chat_template`), else the text's own tokens. `untrusted[k]` (a policy's response) goes where `text` holds
    `slot(k)`, escaped and tokenised alone without special-token matching (`guard`, a `ToolText`), so a response
    cannot write the template's control tokens (end the user turn, open the judge's answer)."""
    template: Optional[str] = getattr(tokenizer, "chat_template", None)
    if use_chat_template and template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    parts, ids = _SLOTS.split(text), []  # trusted text, a slot's index, trusted text, ...
    for k in range(0, len(parts), 2):
        trusted = parts[k]
        # the spaces before a response go with it, as a pre-tokenizer puts a word's leading space in its token
        lead = trusted[len(trusted.rstrip()):] if k + 1 < len(parts) else ""
        ids += tokenizer.encode(trusted[:len(trusted) - len(lead)], add_special_tokens=False)
        if k + 1 < len(parts):
            ids += guard.encode(lead + untrusted[int(parts[k + 1])])
    return [int(t) for t in ids]
