"""megappo.data.loader: seeded per-epoch order, and a saved position that resumes on exactly the same prompts."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megappo.data import EpochSampler, PromptDataset, PromptLoader

N = 23  # prompts; with batch 4 an epoch is 5 full batches and 3 dropped prompts


@pytest.fixture(scope="module")
def dataset(tokenizer_dir, tmp_path_factory):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"how many apples {i}"}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
        }
        for i in range(N)
    ]
    path = tmp_path_factory.mktemp("loader") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=5)
    return PromptDataset(str(path), AutoTokenizer.from_pretrained(tokenizer_dir), max_prompt_length=64)


def signature(batch):
    return batch.indices.tolist(), batch.ground_truths, batch.input_ids.tolist()


def test_sampler_order_is_a_seeded_permutation_per_epoch():
    s = EpochSampler(N, 4, shuffle=True, seed=7)
    assert len(s) == 5
    orders = [s.order(e) for e in range(3)]
    for o in orders:
        assert sorted(o.tolist()) == list(range(N))
    assert not np.array_equal(orders[0], orders[1])  # each epoch reshuffles
    assert np.array_equal(orders[1], EpochSampler(N, 4, seed=7).order(1))  # depends only on (seed, epoch)
    assert not np.array_equal(orders[0], EpochSampler(N, 4, seed=8).order(0))
    assert EpochSampler(N, 4, shuffle=False).order(3).tolist() == list(range(N))
    assert len(EpochSampler(N, 4, drop_last=False)) == 6
    with pytest.raises(ValueError, match="larger than the dataset.*train_batch_size"):
        EpochSampler(3, 4)


def test_loader_yields_epochs_of_full_batches(dataset):
    loader = PromptLoader(dataset, 4, shuffle=True, seed=1)
    first = [b.indices.tolist() for b in loader]
    assert len(first) == 5 and all(len(b) == 4 for b in first) and loader.epoch == 1
    assert len({i for b in first for i in b}) == 20
    second = [b.indices.tolist() for b in loader]
    assert second != first and loader.epoch == 2
    batch = PromptLoader(dataset, 4, shuffle=False).__iter__().__next__()
    assert batch.ground_truths == ["0", "1", "2", "3"]
    assert [len(b) for b in PromptLoader(dataset, 4, shuffle=False, drop_last=False)] == [4, 4, 4, 4, 4, 3]


@pytest.mark.parametrize("consumed", [0, 3, 5, 7])  # start, mid-epoch, exactly at an epoch's end, next epoch
def test_resume_sees_exactly_the_uninterrupted_prompts(dataset, tokenizer_dir, consumed):
    def stream(loader, n):
        out = []
        while len(out) < n:
            for batch in loader:
                out.append(signature(batch))
                if len(out) == n:
                    break
        return out

    total = 14  # almost three epochs
    reference = stream(PromptLoader(dataset, 4, shuffle=True, seed=3), total)

    loader = PromptLoader(dataset, 4, shuffle=True, seed=3)
    head = stream(loader, consumed) if consumed else []
    state = loader.state_dict()
    assert state["epoch"] * 5 + state["batch_index"] == consumed

    # A new process: new dataset object from the same file, new loader, restored position.
    fresh = PromptDataset(dataset.files, AutoTokenizer.from_pretrained(tokenizer_dir), max_prompt_length=64)
    resumed = PromptLoader(fresh, 4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    tail = stream(resumed, total - consumed)
    assert head + tail == reference


def test_restoring_into_a_different_order_is_refused(dataset):
    state = PromptLoader(dataset, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this run has seed=2.*same data files"):
        PromptLoader(dataset, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=4 but this run has batch_size=2"):
        PromptLoader(dataset, 2, seed=1).load_state_dict(state)
