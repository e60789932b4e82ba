"""MnistCNN's options: BatchNorm, and random-affine augmentation drawn from the node's own stream."""

import torch

from exogym.models import MnistCNN
from exogym.models.cnn import random_affine


def test_random_affine_is_the_identity_with_zero_ranges_and_seeded_otherwise():
    x = torch.rand(3, 1, 28, 28)
    assert torch.allclose(random_affine(x, degrees=0, translate=0, scale=(1, 1)), x, atol=1e-5)
    torch.manual_seed(0)
    a = random_affine(x)
    torch.manual_seed(0)
    assert torch.equal(random_affine(x), a) and not torch.allclose(a, x, atol=1e-3)


def test_augmentation_only_in_training_and_batch_norm_present():
    model = MnistCNN(batch_norm=True, augment=True, dropout=0.0)  # only the augmentation is random
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 2
    batch = (torch.rand(4, 1, 28, 28), torch.tensor([1, 2, 3, 4]))
    model.eval()
    with torch.no_grad():
        first, second = model(batch)["loss"], model(batch)["loss"]
    assert torch.equal(first, second)  # eval: no random transform
    model.train()
    torch.manual_seed(1)
    a = model(batch)["loss"]
    torch.manual_seed(2)
    assert not torch.equal(a, model(batch)["loss"])  # train: a different transform per draw
