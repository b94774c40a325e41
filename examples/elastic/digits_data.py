"""A stand-in for ``torchvision.datasets`` / ``transforms`` serving bundled digits.

``datasets.MNIST(root, train=..., download=..., transform=...)`` returns
scikit-learn's 8x8 digits upscaled to 28x28 (1,437 training and 360 test
images, split with a fixed seed), so that MNIST scripts run without a
download. ``transforms.Compose``, ``ToTensor`` and ``Normalize`` behave like
torchvision's on these tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits


class _Transforms:
    class Compose:
        def __init__(self, steps):
            self.steps = list(steps)

        def __call__(self, x):
            for step in self.steps:
                x = step(x)
            return x

    class ToTensor:
        def __call__(self, x):
            return x  # already a float tensor in [0, 1]

    class Normalize:
        def __init__(self, mean, std):
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, x):
            return (x - self.mean) / self.std


transforms = _Transforms()


class _Digits(torch.utils.data.Dataset):
    def __init__(self, root=None, train=True, download=False, transform=None):
        del root, download
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
        labels = torch.tensor(digits.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(labels))
        keep = order[:cut] if train else order[cut:]
        self.images, self.labels = images[keep], labels[keep]
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]


class _Datasets:
    MNIST = _Digits


datasets = _Datasets()
