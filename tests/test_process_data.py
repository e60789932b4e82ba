"""What a process of a run over several is sent: its own nodes' examples (those they read in the run), with the
batches of the whole dataset, bit for bit; nothing of the other nodes."""

import pickle

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from exogym.data.sharding import NodeBatches, keep_rows_read


def _data(n=400):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _batches(ds, rank, **kw):
    return NodeBatches(ds, rank=rank, num_nodes=4, batch_size=8, shuffle=True, seed=3, shard=True, **kw)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("from_step, to_step", [(0, 5), (2, 9), (0, 30)])  # 30 steps: past one epoch (12 steps)
def test_narrowed_batches_are_the_whole_datasets_for_the_steps_run(from_step, to_step):
    whole = _batches(_data(), rank=1)
    narrowed = keep_rows_read(whole, from_step, to_step)
    got, want = narrowed.iterate(from_step), whole.iterate(from_step)
    for _ in range(to_step - from_step):
        assert _same(next(got), next(want))
    assert narrowed.steps_per_epoch == whole.steps_per_epoch and narrowed.shard_size == whole.shard_size
    # What it holds: the rows it reads, nothing of the rest (a node reads 8 rows a step).
    assert len(narrowed.ds.rows) <= 8 * (to_step - from_step) < len(whole.ds) or to_step - from_step >= 12
    assert len(pickle.dumps(narrowed)) < len(pickle.dumps(whole)) or to_step - from_step >= 12


def test_a_row_outside_the_steps_run_is_an_error_not_a_wrong_example():
    narrowed = keep_rows_read(_batches(_data(), rank=0), 0, 2)
    read = set(narrowed.ds.rows.tolist())
    outside = next(i for i in range(400) if i not in read)
    with pytest.raises(IndexError, match="was not given"):
        narrowed.ds[outside]


def test_a_subset_of_a_tensor_dataset_is_narrowed_too_and_gives_the_same_batches():
    data = _data()
    sub = Subset(data, list(range(0, 400, 3)))
    whole = NodeBatches(sub, rank=0, num_nodes=1, batch_size=8, shuffle=True, seed=3, shard=False)
    narrowed = keep_rows_read(whole, 0, 4)
    assert len(narrowed.ds.dataset.rows) == 32
    got, want = narrowed.iterate(0), whole.iterate(0)
    for _ in range(4):
        assert _same(next(got), next(want))


def test_other_datasets_and_dataloader_options_are_sent_whole():
    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.tensor([float(i)])

    plain = _batches(Plain(), rank=0)
    assert keep_rows_read(plain, 0, 2) is plain
    loaded = _batches(_data(), rank=0, loader={"num_workers": 0, "pin_memory": False})
    assert keep_rows_read(loaded, 0, 2) is loaded


def test_a_run_of_many_epochs_is_sent_the_whole_dataset():
    whole = _batches(_data(), rank=1)  # 12 steps an epoch
    assert keep_rows_read(whole, 0, 12 * 4) is not whole and keep_rows_read(whole, 0, 12 * 4 + 1) is whole
