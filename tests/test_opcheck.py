"""torch.library.opcheck for every op over the shared sample cases: every check must say SUCCESS."""

import pytest
import torch

from _samples import CASES, case

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _assert_all_success(result):
    assert set(result) == set(ALL)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_w4a8(name):
    layer, (x, ids, w) = case(name)
    _assert_all_success(torch.library.opcheck(torch.ops.b12x.moe_w4a8.default, (x, ids, w, layer.prepare())))


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_w4a8_out(name):
    layer, (x, ids, w) = case(name)
    out = torch.empty_like(x)
    _assert_all_success(torch.library.opcheck(torch.ops.b12x.moe_w4a8_out.default, (x, ids, w, layer.prepare(), out)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_ep_remap(name):
    layer, (x, ids, w) = case(name)
    _assert_all_success(torch.library.opcheck(torch.ops.b12x.ep_remap.default, (ids, w, layer.offset, layer.E)))
