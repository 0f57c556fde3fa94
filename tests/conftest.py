import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_mesh2():
    """A 2-rank mesh in this process over torch's fake process group (planning needs no collective). The default
    process group it initializes is destroyed afterwards: a test that asks whether torch.distributed is initialized
    (e.g. optim's clip without a process group) must not see one left over."""
    import torch.distributed as dist

    from funcshard.cost import fake_mesh

    yield fake_mesh(2)
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
