"""torch.compile: one b12x node per layer, no graph break, no recompilation as M changes, compiled
equals eager, moe_w4a8_out writes the caller's buffer with no copy, meta models trace."""

import re

import expecttest
import torch
from torch._inductor.utils import run_and_get_code

import b12x_ops
from b12x_ops.models import TinyMoE
from _samples import make_batch, make_layer


def _model(num_layers=3, device="cpu"):
    # router + the op + residual per layer; the handles are plain attributes (graph constants)
    return TinyMoE(num_layers, hidden_size=64, intermediate_size=64, num_experts=4, top_k=2, device=device,
                   backend="reference").requires_grad_(False)


class Capture:
    """A dynamo backend that records each graph it is given and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _normalized(code: str) -> str:
    code = re.sub(r"_lookup\(\d+\)", "_lookup(KEY)", code)
    return "\n".join(line.rstrip() for line in code.strip().splitlines())


class TestCompile(expecttest.TestCase):
    def test_one_node_per_layer_no_recompile(self):
        model = _model(3)
        cap = Capture()
        compiled = torch.compile(model, backend=cap, fullgraph=True, dynamic=True)
        for M in (2, 5, 17, 64):
            x = torch.randn(M, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        self.assertEqual(len(cap.graphs), 1)  # one graph for every M: no recompilation
        gm = cap.graphs[0]
        b12x_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "b12x" in str(n.target)]
        self.assertEqual(len(b12x_nodes), 3)
        self.assertTrue(all(n.target in (torch.ops.b12x.moe_w4a8, torch.ops.b12x.moe_w4a8.default) for n in b12x_nodes))
        first_layer = _normalized(gm.code).split("x = ")[0]
        self.assertExpectedInline(first_layer, """\
def forward(self, L_self_modules_layers_modules_0_modules_router_parameters_weight_ : torch.nn.parameter.Parameter, s77 : torch.SymInt, L_x_ : torch.Tensor, L_self_modules_layers_modules_1_modules_router_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_2_modules_router_parameters_weight_ : torch.nn.parameter.Parameter):
    l_self_modules_layers_modules_0_modules_router_parameters_weight_ = L_self_modules_layers_modules_0_modules_router_parameters_weight_
    l_x_ = L_x_
    l_self_modules_layers_modules_1_modules_router_parameters_weight_ = L_self_modules_layers_modules_1_modules_router_parameters_weight_
    l_self_modules_layers_modules_2_modules_router_parameters_weight_ = L_self_modules_layers_modules_2_modules_router_parameters_weight_
    linear = torch._C._nn.linear(l_x_, l_self_modules_layers_modules_0_modules_router_parameters_weight_, None);  l_self_modules_layers_modules_0_modules_router_parameters_weight_ = None
    logits = linear.float();  linear = None
    topk = torch.topk(logits, 2, dim = -1);  logits = None
    top = topk[0]
    ids = topk[1];  topk = None
    weights = torch.softmax(top, dim = -1);  top = None
    moe_w4a8_default = torch.ops.b12x.moe_w4a8.default(l_x_, ids, weights, PreparedExperts._lookup(KEY));  ids = weights = None
    """)

    def test_inductor_matches_eager(self):
        model = _model(2)
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        for M in (3, 9):
            x = torch.randn(M, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x))

    def test_out_variant_writes_callers_buffer_without_copy(self):
        layer = make_layer()
        handle = layer.prepare()

        def f(x, ids, w, out):
            torch.ops.b12x.moe_w4a8_out(x, ids, w, handle, out)
            return out

        x, ids, w = make_batch(layer, 7)
        out = torch.full_like(x, float("nan"))
        result, (code,) = run_and_get_code(torch.compile(f, fullgraph=True, dynamic=True), x, ids, w, out)
        self.assertEqual(result.data_ptr(), out.data_ptr())
        self.assertTrue(torch.equal(out, torch.ops.b12x.moe_w4a8(x, ids, w, handle)))
        body = code.split("def call(self, args):")[1].split("return")[0]
        calls = [line.strip() for line in body.splitlines() if "torch.ops.b12x" in line]
        self.assertEqual(len(calls), 1)
        self.assertIn("moe_w4a8_out.default(", calls[0])
        self.assertTrue(calls[0].endswith("arg6_1)"))  # `out` is the caller's tensor, the graph input
        self.assertNotIn("copy_", body)  # inductor re-inplaced: the op writes straight into `out`
        self.assertNotIn("empty_strided", body)  # and no staging buffer was allocated

    def test_meta_model_traces(self):
        model = _model(2, device="meta")
        self.assertTrue(all(h.device.type == "meta" for h in model.handles))
        x = torch.empty(11, 64, dtype=torch.bfloat16, device="meta")
        y = model(x)
        self.assertEqual((y.shape, y.device.type, y.dtype), ((11, 64), "meta", torch.bfloat16))
        cap = Capture()
        torch.compile(model, backend=cap, fullgraph=True, dynamic=True)(x)
        self.assertEqual(len(cap.graphs), 1)

    def test_handle_is_a_graph_constant_not_an_input(self):
        # a value-type opaque object is baked in, which is what lets inductor record CUDA graphs
        model = _model(1)
        cap = Capture()
        torch.compile(model, backend=cap, fullgraph=True)(torch.randn(4, 64, dtype=torch.bfloat16))
        placeholders = [n for n in cap.graphs[0].graph.nodes if n.op == "placeholder"]
        self.assertFalse(any("experts" in n.name for n in placeholders))


if __name__ == "__main__":
    import unittest

    unittest.main()
