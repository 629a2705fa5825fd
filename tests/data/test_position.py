"""Data position: resume skips to the interrupted batch without loading skipped samples, for
the standard samplers and for loaders with their own state; other iterables are fast-forwarded
with a warning. Each case resumes from every checkpoint and must equal the uninterrupted run."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, WeightedRandomSampler

import engine
from engine.checkpoint.store.checkpoint_store import CheckpointStore
from engine.checkpoint.store.storage import Storage
from resume_helpers import assert_resumes_are_exact, assert_same_run, copy_run_until, memory_url

SAMPLES = 10


class CountingDataset(Dataset):
    """Samples with a random augmentation drawn from the global RNG; counts loads."""

    def __init__(self):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.loads = 0

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        self.loads += 1
        return self.x[index] + 0.01 * torch.randn(4), self.y[index]


class Regressor(engine.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.dropout = torch.nn.Dropout(0.3)

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(self.dropout(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)


class StatefulLoader:
    """A loader with state_dict()/load_state_dict(), shuffling with its own generator."""

    def __init__(self, dataset, batch_size=3):
        self.dataset = dataset
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(11)
        self.order = None
        self.position = 0
        self.loaded_state = False

    def __len__(self):
        return (len(self.dataset) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        if self.order is None or self.position >= len(self.order):
            self.order = torch.randperm(len(self.dataset), generator=self.generator).tolist()
            self.position = 0
        while self.position < len(self.order):
            indices = self.order[self.position:self.position + self.batch_size]
            self.position += len(indices)
            items = [self.dataset[i] for i in indices]
            yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    def state_dict(self):
        return {"order": self.order, "position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.loaded_state = True
        self.order, self.position = state["order"], state["position"]
        self.generator.set_state(state["generator"])


class PlainIterable:
    """Re-iterable without state: batches in a fixed order."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        for start in range(0, SAMPLES, 4):
            items = [self.dataset[i] for i in range(start, min(start + 4, SAMPLES))]
            yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


LOADERS = {
    "shuffle_global_rng": lambda d: DataLoader(d, batch_size=3, shuffle=True),
    "shuffle_own_generator": lambda d: DataLoader(d, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)),
    "random_with_replacement": lambda d: DataLoader(d, batch_size=3, sampler=RandomSampler(d, replacement=True, num_samples=12)),
    "weighted": lambda d: DataLoader(d, batch_size=2, sampler=WeightedRandomSampler(torch.arange(1.0, SAMPLES + 1), 8)),
    "distributed": lambda d: DataLoader(d, batch_size=2, sampler=DistributedSampler(d, num_replicas=2, rank=1, shuffle=True, seed=3)),
    "no_auto_collation": lambda d: DataLoader(d, batch_size=None, shuffle=True),
    "drop_last": lambda d: DataLoader(d, batch_size=3, shuffle=True, drop_last=True),
    "stateful": lambda d: StatefulLoader(d),
    "plain_iterable": lambda d: PlainIterable(d),
}


def train(loader_name, run_dir, epochs=3, resume="auto"):
    torch.manual_seed(0)
    dataset = CountingDataset()
    loader = LOADERS[loader_name](dataset)
    model = Regressor()
    config = engine.TrainerConfig(max_epochs=epochs, run_dir=run_dir, progress_bar="off",
                                  checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = engine.Trainer(config).fit(model, loader, resume=resume)
    return result, dataset, loader, [str(w.message) for w in caught]


@pytest.mark.parametrize("loader_name", sorted(LOADERS))
def test_resume_from_every_checkpoint_is_exact(loader_name):
    reference = memory_url("data")
    train(loader_name, reference)
    names = CheckpointStore(Storage(reference)).names()
    assert len(names) > 6

    def resume(run_dir):
        result, _, loader, messages = train(loader_name, run_dir)
        fast_forward = [m for m in messages if "drawing and dropping" in m]
        if loader_name == "plain_iterable":
            assert len(fast_forward) <= 1
        else:
            assert not fast_forward
        if loader_name == "stateful":
            assert loader.loaded_state
        return result

    assert_resumes_are_exact(reference, names[:-1], resume)


def test_resume_does_not_load_skipped_samples():
    """Resuming after batch 2 of epoch 1 (batch size 3, 4 batches per epoch) loads only the
    samples of batches 3.. of that epoch and of later epochs: the interrupted batch comes from
    the checkpoint and the skipped ones are never read."""
    reference = memory_url("data")
    _, full_dataset, _, _ = train("shuffle_global_rng", reference)
    assert full_dataset.loads == 3 * SAMPLES
    names = CheckpointStore(Storage(reference)).names()
    store = CheckpointStore(Storage(reference))
    target = next(n for n in names if store.load(n).progress.cursor.as_tuple()[:2] == (1, 2))
    resumed = memory_url("data")
    copy_run_until(reference, resumed, target)
    _, dataset, _, _ = train("shuffle_global_rng", resumed)
    assert dataset.loads == 1 + SAMPLES  # the last batch of epoch 1 (1 sample), then epoch 2
    assert_same_run(reference, resumed)


def test_plain_iterable_warns_once_about_fast_forward():
    reference = memory_url("data")
    train("plain_iterable", reference)
    names = CheckpointStore(Storage(reference)).names()
    resumed = memory_url("data")
    copy_run_until(reference, resumed, names[1])
    _, _, _, messages = train("plain_iterable", resumed)
    assert sum("drawing and dropping" in m for m in messages) == 1


Pair = __import__("collections").namedtuple("Pair", ["x", "y"])


class AttributeRegressor(Regressor):
    def training_step(self, batch):
        return torch.nn.functional.mse_loss(self.layer(self.dropout(batch.x)), batch.y)


def collate_pairs(items):
    return Pair(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))


def test_namedtuple_batches_survive_a_mid_batch_resume():
    """The batch in flight is stored in the checkpoint; a namedtuple batch comes back as a
    namedtuple with the same fields, so the step's attribute access still works."""
    def run(run_dir):
        torch.manual_seed(0)
        loader = DataLoader(CountingDataset(), batch_size=3, shuffle=True, collate_fn=collate_pairs)
        model = AttributeRegressor()
        model.tbptt_split_length = None
        config = engine.TrainerConfig(max_epochs=2, run_dir=run_dir, progress_bar="off",
                                      checkpoint=engine.CheckpointConfig(every_n_splits=1, keep_last=None))
        return engine.Trainer(config).fit(model, loader)

    reference = memory_url("data")
    run(reference)
    names = CheckpointStore(Storage(reference)).names()
    assert_resumes_are_exact(reference, names[:-1], run)
