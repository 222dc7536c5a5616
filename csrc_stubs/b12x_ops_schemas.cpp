// Schema-only declarations of every b12x-ops operator, for C++ hosts (libtorch, AOTInductor).
//
// No kernels live here: a C++ host links this file (or the library built from it) so that the
// dispatcher knows the ops' schemas, and loads the kernels from elsewhere (or only needs the
// schemas, as AOTInductor's generated code does to call the ops by name). The schemas must stay
// identical to b12x_ops/ops.py SCHEMAS; tests/test_csrc_stubs.py builds this file and compares.
//
// Do not load this library into a Python process that also imports b12x_ops: both would define
// the same ops and the second definition fails (loudly, by design).

#include <string>

#include <torch/csrc/jit/frontend/schema_type_parser.h>
#include <torch/library.h>

namespace {

// The handle's opaque type, named as Python names it (module.qualname of PreparedExperts, i.e.
// b12x_ops.handle.HANDLE_TYPE). The schema parser only accepts a type name it knows, so the name
// is registered before the fragment below runs: static initializers of one translation unit run
// in the order of definition, and TORCH_LIBRARY_FRAGMENT's registrar is defined after this one.
constexpr const char* kPreparedExperts = "b12x_ops.handle.PreparedExperts";

const bool kPreparedExpertsRegistered = [] {
  if (!torch::jit::isRegisteredOpaqueType(kPreparedExperts)) {
    torch::jit::registerOpaqueType(kPreparedExperts);
  }
  return true;
}();

}  // namespace

TORCH_LIBRARY_FRAGMENT(b12x, m) {
  // out = sum_j topk_weights[:, j] * FFN_{topk_ids[:, j] - offset}(x), MXFP4 weights, MXFP8 acts.
  m.def(
      "moe_w4a8(Tensor x, Tensor topk_ids, Tensor topk_weights, "
      "b12x_ops.handle.PreparedExperts experts) -> Tensor");
  // The same, written into the caller's buffer (e.g. symmetric memory for a TP all-reduce).
  m.def(
      "moe_w4a8_out(Tensor x, Tensor topk_ids, Tensor topk_weights, "
      "b12x_ops.handle.PreparedExperts experts, Tensor(a!) out) -> ()");
  // Global top-k ids to this expert-parallel rank's local ids: (int32 ids, float32 weights).
  m.def(
      "ep_remap(Tensor topk_ids, Tensor topk_weights, int expert_offset, "
      "int num_local_experts) -> (Tensor, Tensor)");
}
