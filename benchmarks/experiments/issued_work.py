"""The MMA work the blocked path issues at large M against the useful work, on the CPU (no GPU).

    python benchmarks/experiments/issued_work.py [gpt-oss-120b,dsv4.1-tp4,qwen3-30b-a3b] [2048,4096,8192]

The benchmark's ``% bf16 peak`` counts useful FLOPs only, ``2 M top_k (2 N K + N K)``. The GEMMs issue
more: every block runs a tile of ``bm`` rows (or of ``bm / 2`` or ``bm / 4`` where ``plan.tail_tiles``
lets a part-empty block take a smaller one), and every program its whole column tile, also the last one
where ``N`` (GEMM1, ``bn1`` columns of up and of gate) or ``K`` (GEMM2, ``bn2`` outputs) is not a multiple
of the tile. For each geometry and M, with the benchmark's routing (``bench_moe.routing``, the first
layer's seed) and the untuned plan for sm_90 (``plan.default_config``'s block rows, ``plan.gluon_forms``'
tiles): the blocks, the rows the tiles issue against the slots, the column tiles' share of real columns,
and useful / issued FLOPs per GEMM and for both. The achieved share of the bf16 peak divided by that
ratio is the share of the peak the issued MMAs run at.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))


def tile_rows(n: int, bm: int, tail: int) -> int:
    """The rows the tile of a block holding ``n`` of its ``bm`` rows issues (``HALF`` = ``tail``)."""
    if tail >= 2 and n <= bm // 4:
        return bm // 4
    if tail >= 1 and n <= bm // 2:
        return bm // 2
    return bm


def issued(counts, bm: int, tail: int) -> int:
    """Rows issued over the experts' blocks: ``counts`` slots an expert, cut in ``bm``-row blocks."""
    rows = 0
    for c in counts:
        full, rest = divmod(int(c), bm)
        rows += full * bm + (tile_rows(rest, bm, tail) if rest else 0)
    return rows


def work(name: str, M: int, seed: int = 0) -> dict:
    import torch

    from b12x_ops.backends.triton import plan as P
    from bench_moe import GEOMETRIES, plan_geometry, routing

    geo = GEOMETRIES[name]
    E, K, N, top_k = geo["E"], geo["K"], geo["N"], geo["top_k"]
    g = plan_geometry(geo)
    cfg = P.default_config(M, g)
    g1, g2 = P.gluon_forms(cfg.bm, g, M)
    bn1 = (g1 or {}).get("bn1", cfg.bn1)
    bn2 = (g2 or {}).get("bn2", cfg.bn2)
    _, ids, _ = routing(M, E, top_k, "cpu", seed)
    counts = torch.bincount(ids.flatten().long(), minlength=E).tolist()
    slots = M * top_k
    rows = issued(counts, cfg.bm, P.tail_tiles(cfg.bm))
    n1 = -(-N // bn1) * bn1  # GEMM1's columns of up (and as many of gate) the column tiles cover
    k2 = -(-K // bn2) * bn2  # GEMM2's outputs they cover
    use1, use2 = 2 * slots * 2 * N * K, 2 * slots * N * K
    iss1, iss2 = 2 * rows * 2 * n1 * K, 2 * rows * N * k2
    return dict(geometry=name, M=M, bm=cfg.bm, bn1=bn1, bn2=bn2, blocks=sum(-(-c // cfg.bm) for c in counts),
                slots=slots, rows=rows, row_share=slots / rows, col1=N / n1, col2=K / k2, gemm1=use1 / iss1,
                gemm2=use2 / iss2, both=(use1 + use2) / (iss1 + iss2))


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 else "gpt-oss-120b,dsv4.1-tp4,qwen3-30b-a3b").split(",")
    sizes = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "2048,4096,8192").split(",")]
    print("| geometry | M | bm | bn1 / bn2 | blocks | slots / rows issued | GEMM1 columns real | GEMM2 outputs real "
          "| useful / issued: GEMM1 | GEMM2 | both |")
    print("|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for name in names:
        for M in sizes:
            w = work(name, M)
            print(f"| {name} | {M} | {w['bm']} | {w['bn1']} / {w['bn2']} | {w['blocks']} | {w['slots']} / "
                  f"{w['rows']} ({w['row_share']:.1%}) | {w['col1']:.1%} | {w['col2']:.1%} | {w['gemm1']:.1%} "
                  f"| {w['gemm2']:.1%} | {w['both']:.1%} |")


if __name__ == "__main__":
    main()
