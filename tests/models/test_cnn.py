"""MnistCNN's options (BatchNorm, random-affine augmentation drawn from the node's own stream), and the FedAvg
paper's CNN: its parameter count and output."""

import torch

from exogym.models import FedAvgCNN, MnistCNN
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


def test_fedavg_cnn_has_the_papers_parameter_count_and_scores_a_batch():
    model = FedAvgCNN()
    assert sum(p.numel() for p in model.parameters()) == 1_663_370  # McMahan et al. 2017, sec. 3
    images = torch.rand(5, 1, 28, 28)
    assert model.head(model.features(images)).shape == (5, 10)  # logits [B, 10]
    out = model((images, torch.tensor([0, 1, 2, 3, 9])))
    assert set(out) == {"loss", "accuracy"} and out["loss"].shape == out["accuracy"].shape == ()
    assert 0.0 <= out["accuracy"].item() <= 1.0
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())
