"""Which block size pays with the Gluon GEMMs: the whole op at mid-to-large M with the default plan
against 64- and 128-row plans in the Gluon forms of their block size (``plan.gluon_forms``), and with
``TL_DOT=1`` in tl.dot too, on a CUDA GPU (sm_90 for the Gluon forms).

    python benchmarks/experiments/gluon_regimes.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 2048,8192

Per geometry and M, each form's whole op (CUDA-graph replay over 3 layers, us per layer), its expert
blocks, and its output's relative L2 distance from the default plan's (the forms differ in block size
and summation order, not in what they compute).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import experiment_points, form_output_and_us, rel_l2  # noqa: E402


def forms(M, gp):
    """(label, Config) pairs to time at ``M``: the plan's default, then 64- and 128-row plans (the
    tiles the block-size regimes give them) in tl.dot and in their Gluon forms."""
    g = gp.geometry
    base = gp.with_gluon(P.default_config(M, g))
    tiles = {bm: (g1, g2) for _, cands in reversed(P._REGIMES) for bm, g1, g2 in cands}
    tiles.update({bm: (g1, g2) for bm, g1, g2 in P._regime(M, g)})  # (the regime's own tiles first)
    out = [("default plan", base)]
    for bm in (64, 128):
        plain = P.Config(bm, *tiles[bm][0], *tiles[bm][1], base.atomic)
        for label, c in (("tl.dot", plain), ("Gluon forms", gp.with_gluon(plain))):
            if c != base and (TL_DOT or c.gluon):
                out.append((f"{bm}-row blocks, {label}", c))
    return out


TL_DOT = os.environ.get("TL_DOT", "0") == "1"  # (the tl.dot forms too; by default the Gluon ones only)


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        gp = hs[0]._state.plans
        print(f"{name} M={M}", flush=True)
        want = None
        for label, cfg in forms(M, gp):
            try:
                got, t = form_output_and_us(hs, cfg, *batch)
                want = got if want is None else want
                nmax = gp.runner(cfg).blocks(M * gp.geometry.top_k)  # (the entries this call's routing wrote)
                nb = int(gp.arena.buffers["blk_rows"][:nmax].gt(0).sum())
                print(f"  {label} (bm {cfg.bm}, {nb} blocks): {t:.1f} us/layer; rel L2 from the default "
                      f"{rel_l2(got, want):.1e}", flush=True)
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-300:]}", flush=True)


if __name__ == "__main__":
    main()
