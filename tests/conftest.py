import pytest
import torch


# Variants moved behind `slow` to keep the default suite near its budget (each has a faster sibling that stays:
# the apply variant, bf16 params with fp32 reduce, FSDP over TP at W=4)
SLOW = {
    "tests/test_divergence.py::test_check_mode_names_the_first_differing_collective[fully_shard]",
    "tests/test_precision.py::test_fully_shard_matches_fsdp2_bit_for_bit[bf16_bf16-2]",
    "tests/test_tp.py::test_hsdp_over_tp_matches_fsdp2",
    # (4, 1): its all-reduce-only path also runs at (3, 1) in test_fully_shard_matches_fsdp2_at_three_ranks; (4,): the
    # 1-D hook at (3,) there, the int reshard in test_fsdp.py::test_nested_wrapping_and_reshard_after_forward
    "tests/test_mesh2d.py::test_fully_shard_matches_fsdp2_on_2d_meshes[shape2-names2]",
    "tests/test_mesh2d.py::test_fully_shard_matches_fsdp2_on_2d_meshes[shape3-names3]",
    # (1, 4): a replicate axis of 1; the same scenarios run on (2, 2)
    "tests/test_mesh2d.py::test_fully_shard_matches_fsdp2_on_2d_meshes[shape1-names1]",
    # (fp16 parameters: bf16_fp32 runs every scenario in low-precision parameters; fp16_fp32's three are its dtype)
    "tests/test_precision.py::test_fully_shard_matches_fsdp2_bit_for_bit[fp16_fp16-2]",
    "tests/test_precision.py::test_fully_shard_matches_fsdp2_bit_for_bit[fp16_fp32-2]",
    # W = 1: the same 36-case matrix runs at W = 2; W = 1 against the reference also in test_transforms' W = 1 rows
    "tests/test_apply.py::test_parity_with_single_process[1]",
    # int reshard over TP (14 s): FSDP over TP in test_fsdp_over_tp_matches_fsdp2_and_one_process (both forms), the int
    # reshard in test_fsdp.py::test_nested_wrapping_and_reshard_after_forward[2] and test_mesh2d
    "tests/test_tp.py::test_int_reshard_after_forward_with_tp",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
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
