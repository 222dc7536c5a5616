"""Expert and tensor parallelism on the CPU: the sharding index math, and two gloo ranks.

The pure tests prove which experts and which slice of the intermediate dimension a rank takes:
shards put back together are the full weights, decoded shards are slices of the decoded weights,
and the ranks' fp32 partial outputs sum to the single-process output (TP with a SwiGLU limit
included: 32-aligned slices keep the MXFP8 blocks of the intermediate). The multi-process tests run
two real ranks (torch.multiprocessing spawn, gloo on 127.0.0.1) with the reference backend: EP = 2
and TP = 2 all-reduced outputs equal the single-process output over all experts and the b12x
oracle, and a ``DistributedMoE`` compiled with ``fullgraph=True`` holds one b12x node and one
all-reduce and matches eager.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

import b12x_ops
from b12x_ops.backends import reference
from b12x_ops.distributed import (
    DistributedMoE,
    count_moe_nodes,
    expert_range,
    intermediate_range,
    prepare_ep_rank,
    prepare_tp_rank,
    shard_experts,
    shard_intermediate,
)
from b12x_ops.mx import dequantize_mxfp4

from _samples import make_batch, make_layer, oracle, rel_l2

WEIGHTS = ("w13", "w13_scale", "w2", "w2_scale")


def _weights(layer):
    return dict(w13=layer.w13, w13_scale=layer.w13_scale, w2=layer.w2, w2_scale=layer.w2_scale,
                w13_global_scale=layer.w13_global_scale, w2_global_scale=layer.w2_global_scale)


def _fp32(handle, x, ids, w):
    """The reference backend's fp32 output of a handle, before the rounding to bf16."""
    return reference.moe_fp32(handle._state, x, ids, w)


# ------------------------------------------------------------------------------ index math: EP
@pytest.mark.parametrize("num_experts,world_size", [(8, 2), (8, 8), (7, 2), (10, 4), (384, 3), (5, 5), (1, 1)])
def test_expert_range_partitions_the_experts(num_experts, world_size):
    ranges = [expert_range(num_experts, r, world_size) for r in range(world_size)]
    ids = [e for first, count in ranges for e in range(first, first + count)]
    assert ids == list(range(num_experts))  # contiguous, in rank order, each expert once
    counts = [c for _, c in ranges]
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    assert counts == sorted(counts, reverse=True)  # the first ranks take the remainder


def test_expert_range_errors():
    with pytest.raises(ValueError, match="num_experts.*world_size"):
        expert_range(3, 0, 4)
    with pytest.raises(ValueError, match="rank: expected an int in \\[0, 2\\)"):
        expert_range(8, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        expert_range(8, 0, 0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_experts_concatenate_to_the_layer(world_size):
    layer = make_layer(E=7, global_scales=True, seed=3)
    shards = [shard_experts(**_weights(layer), rank=r, world_size=world_size, expert_offset=5)
              for r in range(world_size)]
    for name in WEIGHTS + ("w13_global_scale", "w2_global_scale"):
        assert torch.equal(torch.cat([s[name] for s in shards]), getattr(layer, name))
    offsets = [s["expert_offset"] for s in shards]
    assert offsets == [5 + expert_range(7, r, world_size)[0] for r in range(world_size)]
    assert shards[0]["w13"].data_ptr() == layer.w13.data_ptr()  # views, no copy


def test_shard_experts_errors():
    layer = make_layer(E=2)
    with pytest.raises(ValueError, match="w13: expected at least world_size = 4 experts"):
        shard_experts(**_weights(layer), rank=0, world_size=4)
    with pytest.raises(ValueError, match="w2_scale: expected shape"):
        shard_experts(layer.w13, layer.w13_scale, layer.w2, layer.w2_scale[:, :, :1], rank=0, world_size=2)
    with pytest.raises(ValueError, match="w13_global_scale"):
        shard_experts(**dict(_weights(layer), w13_global_scale=torch.ones(3)), rank=0, world_size=2)


# ------------------------------------------------------------------------------ index math: TP
def test_intermediate_range_and_errors():
    assert [intermediate_range(2880, r, 2) for r in range(2)] == [(0, 1440), (1440, 1440)]
    assert [intermediate_range(576, r, 2) for r in range(2)] == [(0, 288), (288, 288)]
    with pytest.raises(ValueError, match="world_size: expected a split of N = 2880 .* multiples of 32.*gives 720"):
        intermediate_range(2880, 0, 4)  # 720 is not whole MX blocks
    with pytest.raises(ValueError, match="world_size: expected a divisor of the intermediate size N = 96"):
        intermediate_range(96, 0, 5)
    layer = make_layer(N=64)
    with pytest.raises(ValueError, match="shard_intermediate: world_size: .*multiples of 32.*gives 16"):
        shard_intermediate(**_weights(layer), rank=0, world_size=4)
    with pytest.raises(ValueError, match="shard_intermediate: w13_layout"):
        shard_intermediate(**_weights(layer), rank=0, world_size=2, w13_layout="gate_up")
    with pytest.raises(ValueError, match="shard_intermediate: rank"):
        shard_intermediate(**_weights(layer), rank=-1, world_size=2)


@pytest.mark.parametrize("layout", ["w13", "w31"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_intermediate_decodes_to_slices_of_the_layer(layout, world_size):
    N = 32 * world_size * 2
    layer = make_layer(E=3, K=64, N=N, layout=layout, global_scales=True, seed=4)
    full13 = dequantize_mxfp4(layer.w13, layer.w13_scale)  # [E, 2N, K]
    full2 = dequantize_mxfp4(layer.w2, layer.w2_scale)  # [E, K, N]
    shards = []
    for r in range(world_size):
        s = shard_intermediate(**_weights(layer), rank=r, world_size=world_size, w13_layout=layout)
        first, n = intermediate_range(N, r, world_size)
        # the rank's rows of BOTH halves (up and gate, in the layout's order), in order
        want13 = torch.cat((full13[:, first:first + n], full13[:, N + first:N + first + n]), dim=1)
        assert torch.equal(dequantize_mxfp4(s["w13"], s["w13_scale"]), want13)
        assert torch.equal(dequantize_mxfp4(s["w2"], s["w2_scale"]), full2[:, :, first:first + n])
        assert s["w13_global_scale"] is layer.w13_global_scale and s["expert_offset"] == 0
        assert all(s[k].is_contiguous() for k in WEIGHTS)
        shards.append(s)
    # and put back together they are the layer's bytes
    halves = [torch.cat([s[k].chunk(2, dim=1)[h] for s in shards], dim=1) for k in ("w13", "w13_scale") for h in (0, 1)]
    assert torch.equal(torch.cat(halves[:2], dim=1), layer.w13)
    assert torch.equal(torch.cat(halves[2:], dim=1), layer.w13_scale)
    assert torch.equal(torch.cat([s["w2"] for s in shards], dim=2), layer.w2)
    assert torch.equal(torch.cat([s["w2_scale"] for s in shards], dim=2), layer.w2_scale)


# -------------------------------------------------- the partials sum to the single-process output
def test_ep_fp32_partials_sum_to_the_full_layer():
    layer = make_layer(E=7, K=64, N=64, top_k=3, global_scales=True, limit=7.0, seed=5)
    x, ids, w = make_batch(layer, 23, padding_rows=3, foreign=False, seed=5)
    full = _fp32(layer.prepare(), x, ids, w)
    total = sum(_fp32(prepare_ep_rank(**_weights(layer), rank=r, world_size=3, top_k=3, swiglu_limit=7.0,
                                      backend="reference"), x, ids, w) for r in range(3))
    assert rel_l2(total, full) < 1e-6


@pytest.mark.parametrize("layout", ["w13", "w31"])
def test_tp_fp32_partials_sum_to_the_full_layer_with_swiglu_limit(layout):
    # The SwiGLU (limit included) is elementwise over N and dq8 of the intermediate is per 32 along
    # N: a rank's 32-aligned slice sees exactly the single-GPU blocks, so the fp32 partials are exact
    # pieces of the single-GPU sum (only the summation order differs).
    layer = make_layer(E=4, K=64, N=128, top_k=2, layout=layout, limit=2.0, global_scales=True, seed=6)
    x, ids, w = make_batch(layer, 19, padding_rows=2, seed=6, x_scale=4.0)
    full = _fp32(layer.prepare(), x, ids, w)
    parts = [_fp32(prepare_tp_rank(**_weights(layer), rank=r, world_size=4, top_k=2, w13_layout=layout,
                                   swiglu_limit=2.0, backend="reference"), x, ids, w) for r in range(4)]
    assert rel_l2(sum(parts), full) < 1e-6
    # the limit really clips here, so the check covers the clamp
    h = x.float() @ dequantize_mxfp4(layer.w13, layer.w13_scale)[0].T
    assert bool((h.abs() > 2.0).any())


def test_ep_and_tp_compose():
    layer = make_layer(E=4, K=64, N=64, top_k=2, global_scales=True, limit=7.0, layout="w31", seed=7)
    x, ids, w = make_batch(layer, 16, foreign=False, seed=7)
    full = _fp32(layer.prepare(), x, ids, w)
    total = 0
    for ep in range(2):
        for tp in range(2):
            s = shard_intermediate(**shard_experts(**_weights(layer), rank=ep, world_size=2),
                                   rank=tp, world_size=2, w13_layout="w31")
            h = b12x_ops.prepare_experts(**s, top_k=2, w13_layout="w31", swiglu_limit=7.0, backend="reference")
            assert (h.num_experts, h.intermediate_size) == (2, 32)
            total = total + _fp32(h, x, ids, w)
    assert rel_l2(total, full) < 1e-6


def test_distributed_moe_single_rank_is_router_plus_op():
    layer = make_layer(E=6, K=64, N=64, top_k=2, seed=8)
    h = layer.prepare()
    router = torch.randn(6, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for renormalize in (True, False):
        moe = DistributedMoE(h, router, renormalize=renormalize)
        ids, w = moe.route(x.reshape(-1, 64))
        assert torch.allclose(w.sum(-1), torch.ones(15)) == renormalize
        assert torch.equal(moe(x), b12x_ops.moe_w4a8(x.reshape(-1, 64), ids, w, h).view(3, 5, 64))
    with pytest.raises(ValueError, match="router_weight: expected at least 6 rows"):
        DistributedMoE(h, router[:4])


# ---------------------------------------------------------------------- two gloo ranks, spawned
# One spawn runs every multi-process check (a process start costs seconds); rank 0 saves what it
# saw and the tests below judge it.
WORLD = 2
EP_LAYER = dict(E=8, K=64, N=64, top_k=3, global_scales=True, limit=7.0, seed=11)
TP_LAYER = dict(E=4, K=64, N=128, top_k=2, layout="w31", limit=7.0, global_scales=True, seed=12)
M = 24


def _inputs():
    ep, tp = make_layer(**EP_LAYER), make_layer(**TP_LAYER)
    ep_batch = make_batch(ep, M, padding_rows=3, foreign=False, seed=11)
    tp_batch = make_batch(tp, M, padding_rows=3, foreign=False, seed=12)
    g = torch.Generator().manual_seed(13)
    router = (torch.randn(ep.E, ep.K, generator=g) / 4).to(torch.bfloat16)
    xr = torch.randn(M, ep.K, generator=g).to(torch.bfloat16)
    return ep, tp, ep_batch, tp_batch, router, xr


def _worker(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist
    from torch._dynamo.backends.common import aot_autograd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ep, tp, (x, ids, w), (xt, idst, wt), router, xr = _inputs()
        res = {}
        # EP: this rank's experts, the same global ids on every rank, partials summed
        h_ep = prepare_ep_rank(**_weights(ep), rank=rank, world_size=WORLD, top_k=ep.top_k,
                               swiglu_limit=ep.limit, backend="reference")
        out = torch.empty_like(x)
        b12x_ops.moe_w4a8_out(x, ids, w, h_ep, out)
        res["ep_partial"] = out.clone()
        dist.all_reduce(out)
        res["ep"] = out
        res["ep_range"] = (h_ep.expert_offset, h_ep.num_experts)
        # TP: this rank's slice of N
        h_tp = prepare_tp_rank(**_weights(tp), rank=rank, world_size=WORLD, top_k=tp.top_k,
                               w13_layout=tp.layout, swiglu_limit=tp.limit, backend="reference")
        out = torch.empty_like(xt)
        b12x_ops.moe_w4a8_out(xt, idst, wt, h_tp, out)
        dist.all_reduce(out)
        res["tp"] = out
        res["tp_n"] = h_tp.intermediate_size
        # the layer, eager and compiled whole
        group = dist.group.WORLD
        for mode, handle in (("ep", h_ep), ("tp_layer", None)):
            if handle is None:  # a TP layer of the EP layer's experts, to reuse the router
                handle = prepare_tp_rank(**_weights(ep), rank=rank, world_size=WORLD, top_k=ep.top_k,
                                         swiglu_limit=ep.limit, backend="reference")
            moe = DistributedMoE(handle, router, group=group)
            res[f"{mode}_moe_eager"] = moe(xr)
            graphs = []

            def record(gm, example_inputs, graphs=graphs):
                graphs.append(gm)
                return gm.forward

            torch._dynamo.reset()
            traced = torch.compile(moe, fullgraph=True, backend=aot_autograd(fw_compiler=record))
            res[f"{mode}_moe_traced"] = traced(xr)
            res[f"{mode}_counts"] = [count_moe_nodes(gm) for gm in graphs]
        torch._dynamo.reset()
        compiled = torch.compile(DistributedMoE(h_ep, router, group=group), fullgraph=True)
        res["ep_moe_inductor"] = compiled(xr)
        res["ep_moe_inductor_odd_m"] = (compiled(xr[:7]), DistributedMoE(h_ep, router, group=group)(xr[:7]))
        if rank == 0:
            torch.save(res, os.path.join(outdir, "rank0.pt"))
        dist.barrier()  # no rank tears its transport down while the other still talks to it
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    import torch.multiprocessing as mp

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only: CI boxes may not resolve their name
    outdir = str(tmp_path_factory.mktemp("gloo"))
    mp.spawn(_worker, args=(_free_port(), outdir), nprocs=WORLD, join=True)
    return torch.load(os.path.join(outdir, "rank0.pt"), weights_only=False)


@pytest.fixture(scope="module")
def single():
    """The single-process results over all experts, and the oracle."""
    ep, tp, (x, ids, w), (xt, idst, wt), router, xr = _inputs()
    h = ep.prepare()
    return {
        "ep": b12x_ops.moe_w4a8(x, ids, w, h),
        "tp": b12x_ops.moe_w4a8(xt, idst, wt, tp.prepare()),
        "moe": DistributedMoE(h, router)(xr),
        "moe_odd": DistributedMoE(h, router)(xr[:7]),
        "ep_oracle": lambda: oracle(ep, x, ids, w),
        "tp_oracle": lambda: oracle(tp, xt, idst, wt),
        "ep_partial0": b12x_ops.moe_w4a8(x, ids, w, prepare_ep_rank(
            **_weights(ep), rank=0, world_size=WORLD, top_k=ep.top_k, swiglu_limit=ep.limit, backend="reference")),
    }


# The ranks round their partials to bf16 before the all-reduce (as an engine does), so a layer's
# result is within a couple of bf16 roundings of the single-process one, not bit-equal.
TOL = 5e-3  # measured 2e-3 to 3e-3


def test_gloo_ep2_equals_single_process_and_oracle(gloo_run, single):
    assert gloo_run["ep_range"] == (0, 4)
    assert torch.equal(gloo_run["ep_partial"], single["ep_partial0"])
    assert rel_l2(gloo_run["ep"], single["ep"]) < TOL
    assert rel_l2(gloo_run["ep"], single["ep_oracle"]()) < TOL
    assert gloo_run["ep"][-3:].abs().max() == 0  # padding rows


def test_gloo_tp2_equals_single_process_and_oracle(gloo_run, single):
    assert gloo_run["tp_n"] == 64
    assert rel_l2(gloo_run["tp"], single["tp"]) < TOL
    assert rel_l2(gloo_run["tp"], single["tp_oracle"]()) < TOL


@pytest.mark.parametrize("mode", ["ep", "tp_layer"])
def test_gloo_distributed_moe_compiles_to_one_b12x_node_and_one_all_reduce(gloo_run, single, mode):
    assert gloo_run[f"{mode}_counts"] == [{"b12x": 1, "all_reduce": 1}]
    assert torch.equal(gloo_run[f"{mode}_moe_traced"], gloo_run[f"{mode}_moe_eager"])
    assert rel_l2(gloo_run[f"{mode}_moe_eager"], single["moe"]) < TOL


def test_gloo_distributed_moe_under_inductor(gloo_run, single):
    assert rel_l2(gloo_run["ep_moe_inductor"], gloo_run["ep_moe_eager"]) < 1e-6
    got, eager = gloo_run["ep_moe_inductor_odd_m"]
    assert rel_l2(got, eager) < 1e-6 and rel_l2(got, single["moe_odd"]) < TOL
