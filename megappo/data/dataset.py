"""A Parquet prompt dataset, tokenised once at load time, and the left-padded batch it collates into.

Files are read row group by row group (see `schema.read_prompt_rows`); prompts are rendered with the tokenizer's
chat template (add_generation_prompt=True) when it has one, else the message contents are joined with newlines.
Length rules are applied while loading, so a run never stops midway on a long prompt:

- filter_overlong_prompts=True drops prompts longer than max_prompt_length (counted in `num_filtered`);
- otherwise truncation "left" keeps the last max_prompt_length tokens, "right" the first, and "error" raises a
  DataError naming the first overlong row (a prompt with images is never cut: its image tokens must stay whole).

Multimodal files (an `images` column, `data.image_key`; see `megappo.data.multimodal`) need the model's
`ImageProcessing` (`megappo.data.images`): each `<image>` is expanded into its image tokens at load time, and the
images are decoded and processed when a batch is collated (`PromptBatch.multi_modal`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import numpy as np
import torch

from megappo.data.images import ImageProcessing, ImageSource, NoImages
from megappo.data.multimodal import MultiModalInputs, select_rows
from megappo.data.schema import DataError, PromptRow, expand_files, read_prompt_rows

Truncation = Literal["error", "left", "right"]


@dataclass
class PromptRecord:
    """One prompt of the dataset."""

    input_ids: np.ndarray  # [L] int32, L <= max_prompt_length, chat template applied, no padding
    row: PromptRow  # messages, data_source, ground_truth, extra_info, ...
    file: str  # the Parquet file it came from
    images: Optional[list[ImageSource]] = None  # its images, in placeholder order (None: a text prompt)


@dataclass
class PromptBatch:
    """B prompts, left-padded to a common length P so generation appends on the right."""

    input_ids: torch.Tensor  # [B, P] int64, pad_token_id on the left
    attention_mask: torch.Tensor  # [B, P] int64, 1 on prompt tokens, 0 on padding
    position_ids: torch.Tensor  # [B, P] int64, 0 at each prompt's first token (and on the padding before it)
    raw_prompts: list[list[dict]]  # B chat message lists, as in the file
    data_sources: list[str]  # B
    ground_truths: list[Any]  # B, reward_model.ground_truth (usually str)
    extra_infos: list[dict]  # B
    abilities: list[str]  # B
    indices: torch.Tensor  # [B] int64, each prompt's position in the dataset
    # B entries (None for a prompt without images) when any prompt of the batch has images; None for text batches
    multi_modal: Optional[list[Optional[MultiModalInputs]]] = None
    agent_names: Optional[list[Optional[str]]] = None  # B, the rows' agent_name (None: the run's default agent)

    def __post_init__(self) -> None:
        if self.agent_names is None:
            self.agent_names = [None] * self.input_ids.shape[0]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: list[int]) -> "PromptBatch":
        """The prompts at `rows`, in that order (still padded to this batch's P)."""
        index = torch.tensor(rows, dtype=torch.long)
        return PromptBatch(self.input_ids[index], self.attention_mask[index], self.position_ids[index],
                           [self.raw_prompts[r] for r in rows], [self.data_sources[r] for r in rows],
                           [self.ground_truths[r] for r in rows], [self.extra_infos[r] for r in rows],
                           [self.abilities[r] for r in rows], self.indices[index],
                           select_rows(self.multi_modal, rows), [self.agent_names[r] for r in rows])


def _render(tokenizer, messages: list[list[dict]], chat_template_kwargs: dict) -> tuple[list[str], bool]:
    """Prompt texts for a batch of conversations; the bool says whether a chat template was used."""
    if getattr(tokenizer, "chat_template", None):
        texts = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
        )
        return list(texts), True
    return ["\n".join(m["content"] for m in conv) for conv in messages], False


class PromptDataset:
    """The prompts of one or more Parquet files in verl's schema, tokenised and length-checked.

    Args:
        files: one path, a list of paths, or directories of *.parquet (data.train_files / data.val_files).
        tokenizer: a `transformers` tokenizer; its chat template is used when it has one.
        max_prompt_length: most prompt tokens after the chat template (data.max_prompt_length).
        truncation: "error" | "left" | "right" (data.truncation), for prompts over the limit that are not filtered.
        filter_overlong_prompts: drop prompts over the limit instead (data.filter_overlong_prompts).
        prompt_key: the column of chat messages (data.prompt_key).
        chat_template_kwargs: extra arguments for apply_chat_template, e.g. {"enable_thinking": False}.
        image_processing: the model's image processing (its kind's `image_processing`, `megappo.kinds`); None
            for a text-only model, which then refuses files with images.
        image_key: the column of images (data.image_key).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        *,
        max_prompt_length: int = 512,
        truncation: Truncation = "error",
        filter_overlong_prompts: bool = False,
        prompt_key: str = "prompt",
        chat_template_kwargs: dict | None = None,
        read_batch_rows: int = 1024,
        image_processing: Optional[ImageProcessing] = None,
        image_key: str = "images",
    ):
        if truncation not in ("error", "left", "right"):
            raise ValueError(f"data.truncation must be error, left or right, got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        self.files = expand_files(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_token_id is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token before "
                             "building the dataset")
        self.records: list[PromptRecord] = []
        self.num_filtered = 0  # prompts dropped by filter_overlong_prompts
        self.num_truncated = 0  # prompts cut by truncation left/right
        self.uses_chat_template = False
        self.image_processing, self.image_key = image_processing, image_key
        self._images = image_processing or NoImages()  # what a prompt's images become, chosen once
        for path in self.files:
            for rows in read_prompt_rows(path, prompt_key, batch_rows=read_batch_rows, image_key=image_key):
                self._add(path, rows, prompt_key, chat_template_kwargs or {})
        if not self.records:
            raise DataError(", ".join(self.files), f"all {self.num_filtered} prompts are longer than "
                            f"max_prompt_length={max_prompt_length} and were filtered",
                            "raise data.max_prompt_length or set data.filter_overlong_prompts=false with "
                            "data.truncation=left")

    def _add(self, path: str, rows: list[PromptRow], prompt_key: str, chat_template_kwargs: dict) -> None:
        try:
            texts, self.uses_chat_template = _render(self.tokenizer, [r.messages for r in rows], chat_template_kwargs)
        except Exception:
            # Find the row the template rejects, so the error can name it.
            for r in rows:
                try:
                    _render(self.tokenizer, [r.messages], chat_template_kwargs)
                except Exception as e:
                    raise DataError(path, f"the chat template failed on this prompt ({type(e).__name__}: {e})",
                                    "fix the messages' roles/order for this model's template", row=r.file_row,
                                    column=prompt_key) from e
            raise
        images = [self._images.prompt_images(r.images, path, r.file_row, self.image_key) for r in rows]
        texts = [self._images.expand_prompt(t, imgs, path, r.file_row, self.image_key, prompt_key)
                 for t, r, imgs in zip(texts, rows, images)]
        # A chat template writes its own special tokens (bos included); plain text gets the tokenizer's usual ones.
        encoded = self.tokenizer(texts, add_special_tokens=not self.uses_chat_template)["input_ids"]
        limit = self.max_prompt_length
        for row, ids, imgs in zip(rows, encoded, images):
            if not ids:
                raise DataError(path, "the prompt tokenises to nothing", "give the row non-empty message content",
                                row=row.file_row, column=prompt_key)
            if len(ids) > limit:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.truncation == "error" or imgs is not None:
                    raise DataError(path, f"the prompt has {len(ids)} tokens, over max_prompt_length={limit}",
                                    "raise data.max_prompt_length, set data.filter_overlong_prompts=true, or set "
                                    "data.truncation=left|right (prompts with images are never cut)",
                                    row=row.file_row, column=prompt_key)
                ids = ids[-limit:] if self.truncation == "left" else ids[:limit]
                self.num_truncated += 1
            self.records.append(PromptRecord(np.asarray(ids, dtype=np.int32), row, path, imgs))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

    def collate(self, indices: Sequence[int], pad_to: int | None = None) -> PromptBatch:
        return collate([self.records[i] for i in indices], indices, self.pad_token_id, pad_to=pad_to,
                       image_processing=self.image_processing)


def collate(
    records: Sequence[PromptRecord], indices: Sequence[int], pad_token_id: int, pad_to: int | None = None,
    image_processing: Optional[ImageProcessing] = None,
) -> PromptBatch:
    """Left-pad `records` to the longest of them (or to `pad_to`) and stack them into a PromptBatch; the images
    of prompts that have them are decoded and processed here (`image_processing`)."""
    longest = max(len(r.input_ids) for r in records)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
    input_ids = torch.full((len(records), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(records), width), dtype=torch.long)
    for b, r in enumerate(records):
        n = len(r.input_ids)
        input_ids[b, width - n:] = torch.from_numpy(r.input_ids.astype(np.int64))
        attention_mask[b, width - n:] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    multi_modal = (image_processing or NoImages()).batch_inputs([r.images for r in records])
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        raw_prompts=[r.row.messages for r in records],
        data_sources=[r.row.data_source for r in records],
        ground_truths=[r.row.ground_truth for r in records],
        extra_infos=[r.row.extra_info for r in records],
        abilities=[r.row.ability for r in records],
        agent_names=[r.row.agent_name for r in records],
        indices=torch.as_tensor(list(indices), dtype=torch.long),
        multi_modal=multi_modal,
    )
