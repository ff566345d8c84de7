"""The trainer's side of reward_model.judge's skip policy: a skipped group keeps its place in the batch (mini-batches
and data-parallel shares stay even) but adds no token to a loss."""
from __future__ import annotations

from megappo.trainer.dynamic_sampling import without_training
from megappo.trainer.experience import Samples, build_experience


def _samples() -> Samples:
    n = 4
    return Samples(prompt_ids=[[5, 6, 7]] * n, response_ids=[[8, 9], [8], [9, 9, 1], [1]],
                   rollout_log_probs=[[-0.1, -0.2], [-0.3], [-0.1, -0.1, -0.1], [-0.5]], truncated=[False] * n,
                   uids=[0, 0, 1, 1], data_sources=["d"] * n, ground_truths=["8"] * n, extra_infos=[{}] * n,
                   weight_versions=[0] * n, dataset_indices=[0, 0, 1, 1], partial=[False] * n)


def test_a_skipped_group_trains_on_nothing_and_keeps_its_rows():
    samples = _samples()
    kept = without_training(samples, [False, False, True, True])
    assert len(kept) == 4 and kept.loss_masks == [None, None, [0, 0, 0], [0]]
    exp = build_experience(kept, [0, 1, 2, 3], pad_token_id=0)
    assert exp.mask[:2].sum().item() == 3 and exp.mask[2:].sum().item() == 0
    assert exp.last_scored_index().tolist()[2:] == [0, 0]  # no token of theirs carries a score
    assert build_experience(samples, [0, 1, 2, 3], 0).mask.sum().item() == 7  # the input is not changed


def test_the_judge_reads_the_rows_question_else_the_decoded_prompt(tokenizer_dir):
    import transformers

    from megappo.trainer.experience import _question
    from megappo.trainer.judge import questions

    assert _question([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"}]) == "2 + 2?"
    assert _question([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]) \
        == "what colour?"
    assert _question(None) is None and _question([]) is None
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    samples = _samples()
    samples.questions = ["from the row", "from the row", None, None]
    samples.prompt_ids = [tok("ignored")["input_ids"]] * 2 + [tok("hello world")["input_ids"]] * 2
    assert questions(tok, samples) == ["from the row", "from the row", "hello world", "hello world"]
