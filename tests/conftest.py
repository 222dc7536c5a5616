import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    sm12x = has_gpu and torch.cuda.get_device_capability()[0] == 12
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none here)"))
        if "sm12x" in item.keywords and not sm12x:
            item.add_marker(pytest.mark.skip(reason="needs an SM120/SM121 GPU (none here)"))
