"""A stand-in ``torchvision`` for MosaicML streaming (docs/comparison.md, installing the peers).

``import streaming`` imports ``torchvision.datasets.VisionDataset`` (and a few
more names) through its vision package, and installing torchvision would
replace the CPU torch with a CUDA build. Nothing on the text path uses them;
this registers empty modules with those names before ``streaming`` is imported.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types


def install() -> None:
    if "torchvision" in sys.modules:
        return
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class VisionDataset:  # never instantiated on the text path
        pass

    datasets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
    datasets.CIFAR10 = VisionDataset  # type: ignore[attr-defined]
    functional.to_tensor = lambda x: x  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = datasets, transforms  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    mods = {
        "torchvision": tv,
        "torchvision.datasets": datasets,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
    }
    for name, mod in mods.items():
        # transformers probes importlib.util.find_spec("torchvision"), which needs a spec
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules.update(mods)
