"""The epoch sampler, per-batch augmentation seeds, loader workers, the model-input conversion and the eval transform."""

import numpy as np
import torch

from vitflow.data import EpochSampler, open_split
from vitflow.data.loader import BatchDataset, make_loader
from vitflow.data.transforms import Preprocess, eval_transform, model_input, train_transform


def test_sampler_epochs_shards_and_resume():
    s = EpochSampler(100, 10, shuffle=True, drop_last=True, seed=3, epochs=2)
    refs = list(s)
    assert len(refs) == 20
    assert sorted(np.concatenate([r.indices for r in refs[:10]])) == list(range(100))
    assert not np.array_equal(refs[0].indices, refs[10].indices)  # a new permutation each epoch
    resumed = list(EpochSampler(100, 10, shuffle=True, drop_last=True, seed=3, epochs=2, start=(0, 7)))
    assert [(r.epoch, r.index) for r in resumed] == [(r.epoch, r.index) for r in refs[7:]]
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(resumed, refs[7:]))
    shards = [np.concatenate([r.indices for r in EpochSampler(103, 5, True, True, seed=1, epochs=1, rank=k,
                                                              world_size=2)]) for k in range(2)]
    assert len(shards[0]) == len(shards[1]) == 50
    assert set(shards[0]).isdisjoint(shards[1])


def test_augmentation_is_a_function_of_seed_epoch_and_batch(image_folder):
    src = open_split(image_folder, "train")
    ds = BatchDataset(src, train_transform(8, "pad_crop", padding=2, hflip=True), seed=5)
    ref = next(iter(EpochSampler(len(src), 8, True, True, seed=5)))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = ds[ref], ds[ref]
    assert torch.equal(a["images"], b["images"])
    assert torch.equal(torch.get_rng_state(), before)  # the global (model) RNG is untouched
    other = ds[type(ref)(ref.epoch + 1, ref.index, ref.indices)]
    assert not torch.equal(a["images"], other["images"])  # same images, another epoch: new draws


def test_loader_workers_match_main_process(image_folder):
    src = open_split(image_folder, "train")
    tf = train_transform(8, "pad_crop", padding=2)

    def run(workers):
        s = EpochSampler(len(src), 4, True, True, seed=1, epochs=2)
        return [(b["epoch"], b["index"], b["images"]) for b in make_loader(src, tf, s, workers, seed=1)]

    main, workers = run(0), run(2)
    assert len(main) == len(workers) == 12
    for (e0, i0, x0), (e1, i1, x1) in zip(main, workers):
        assert (e0, i0) == (e1, i1) and torch.equal(x0, x1)


def test_normalize_batched():
    x = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(2, 3, 1, 2)
    y = model_input(x, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert y.dtype == torch.float32
    assert torch.allclose(y[..., 0], torch.tensor(-1.0)) and torch.allclose(y[..., 1], torch.tensor(1.0))
    half = model_input(x[0], (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "cpu", torch.bfloat16)  # one image, bf16 model
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), y[0])


def test_eval_transform_resize_and_center_crop():
    img = torch.arange(3 * 40 * 60, dtype=torch.int64).remainder(256).to(torch.uint8).view(3, 40, 60)
    out = eval_transform(Preprocess(32, crop_pct=0.8))(img)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
