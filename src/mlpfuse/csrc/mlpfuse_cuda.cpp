// mlpfuse's CUDA backend: one entry per op. Each checks every tensor once (shapes, dtypes, devices; a bad one raises
// a c10 ValueError naming the argument, which mlpfuse turns into one InputError line), then runs cuBLAS(Lt) GEMMs
// through ATen and the hand-written kernels of glu.cu / decode.cu on the current stream.
//
// Activations are 2-D [tokens, features] (mlpfuse flattens leading dimensions before calling); weights are in
// nn.Linear layout [out_features, in_features].
#include <optional>
#include <string>
#include <vector>

// c10/cuda only (no ATen/cuda): those headers pull in cuBLAS and cuSPARSE, which a compiler-only toolkit lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "kernels.h"

namespace mlpfuse {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    default: return DType::f32;
  }
}

// The reference every other tensor must match: a CUDA tensor of a supported dtype with `dims` dimensions.
void check_lead(const char* name, const Tensor& t, int64_t dims) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  TORCH_CHECK_VALUE(t.is_cuda(), name, ": the cuda backend needs CUDA tensors, got one on ", t.device());
  const auto st = t.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, name,
                    ": the cuda backend supports bfloat16, float16 and float32, got ", st);
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name, ": expected a dense (strided) tensor");
  TORCH_CHECK_VALUE(t.dim() == dims, name, ": expected ", dims, " dimensions, got shape ", shape_str(t));
}

// t has `shape` and lead's dtype and device.
void check_like(const char* name, const Tensor& t, const Tensor& lead, std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  TORCH_CHECK_VALUE(t.device() == lead.device(), name, ": expected a tensor on ", lead.device(), ", got one on ",
                    t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == lead.scalar_type(), name, ": expected dtype ", lead.scalar_type(), ", got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name, ": expected a dense (strided) tensor");
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  int64_t i = 0;
  for (int64_t s : shape) same = same && t.size(i++) == s;
  if (same) return;  // the message is built only for a bad shape: every call checks several tensors
  std::string want = "[";
  i = 0;
  for (int64_t s : shape) want += (i++ ? ", " : "") + std::to_string(s);
  TORCH_CHECK_VALUE(false, name, ": expected shape ", want, "], got ", shape_str(t));
}

void check_opt(const char* name, const OptTensor& t, const Tensor& lead, int64_t n) {
  if (t.has_value() && t->defined()) check_like(name, *t, lead, {n});
}

const void* ptr_or_null(const OptTensor& t) { return t.has_value() && t->defined() ? t->data_ptr() : nullptr; }

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// The kernels read rows of unit column stride; anything else is copied once here.
Tensor unit_cols(const Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous(); }

Mat mat(const Tensor& t) { return {t.data_ptr(), t.size(0) > 1 ? t.stride(0) : t.size(1)}; }

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// x·wᵀ (+ b): one cuBLAS GEMM with the bias in its epilogue.
Tensor gemm_bias(const Tensor& x, const Tensor& w, const OptTensor& b) {
  return given(b) ? at::addmm(*b, x, w.t()) : at::mm(x, w.t());
}

void check_act(int64_t act) {
  TORCH_CHECK_VALUE(act >= IDENTITY && act <= QUICK_GELU, "activation: unknown activation id ", act);
}

void check_gated(const Tensor& x, const Tensor& wg, const Tensor& wu, const Tensor& wd, const OptTensor& bg,
                 const OptTensor& bu, const OptTensor& bd) {
  check_lead("x", x, 2);
  const int64_t dim = x.size(1);
  TORCH_CHECK_VALUE(wg.defined() && wg.dim() == 2, "gate_weight: expected a 2-D [hidden, dim] tensor");
  const int64_t hidden = wg.size(0);
  check_like("gate_weight", wg, x, {hidden, dim});
  check_like("up_weight", wu, x, {hidden, dim});
  check_like("down_weight", wd, x, {dim, hidden});
  check_opt("gate_bias", bg, x, hidden);
  check_opt("up_bias", bu, x, hidden);
  check_opt("down_bias", bd, x, dim);
}

// The decode kernels, when they apply: a few tokens and 16-byte aligned rows. They sum in a fixed order, so
// deterministic mode needs no fallback. Two allocations (h, y) from the caching allocator and two launches.
Tensor try_decode(const Tensor& x, const Tensor& wg, const Tensor& wu, const Tensor& wd, const OptTensor& bg,
                  const OptTensor& bu, const OptTensor& bd, int64_t act) {
  const int64_t m = x.size(0), dim = x.size(1), hidden = wg.size(0);
  if (m < 1 || m > kDecodeMaxM) return Tensor();
  if (x.stride(1) != 1 || wg.stride(1) != 1 || wu.stride(1) != 1 || wd.stride(1) != 1) return Tensor();
  const void* ptrs[] = {x.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr()};
  const int64_t lds[] = {mat(x).ld, wg.stride(0), wu.stride(0), wd.stride(0)};
  if (!decode_supported(dtype_of(x), m, dim, hidden, ptrs, 4, lds, 4)) return Tensor();
  Tensor h = at::empty({m, hidden}, x.options());
  Tensor y = at::empty({m, dim}, x.options());
  decode_gated_mlp(dtype_of(x), static_cast<int>(act), m, dim, hidden, mat(x), mat(wg), mat(wu), mat(wd),
                   ptr_or_null(bg), ptr_or_null(bu), ptr_or_null(bd), Mat{h.data_ptr(), hidden}, mat(y), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

// y = down(act(x·Wgᵀ + bg)·(x·Wuᵀ + bu)) + bd. Returns [y, h, g, u]; h, g, u only with save_preact (else
// undefined, None in Python). allow_decode: the decode kernel may run (inference only: it keeps no h, g or u).
std::vector<Tensor> gated_mlp_forward(const Tensor& x, const Tensor& wg, const Tensor& wu, const Tensor& wd,
                                      const OptTensor& bg, const OptTensor& bu, const OptTensor& bd, int64_t act,
                                      bool save_preact, bool allow_decode) {
  check_gated(x, wg, wu, wd, bg, bu, bd);
  check_act(act);
  const c10::cuda::CUDAGuard guard(x.device());
  if (allow_decode && !save_preact) {
    Tensor y = try_decode(x, wg, wu, wd, bg, bu, bd, act);
    if (y.defined()) return {y, Tensor(), Tensor(), Tensor()};
  }
  Tensor g = gemm_bias(x, wg, bg), u = gemm_bias(x, wu, bu);
  // Without save_preact nobody reads g again: h is written over it.
  Tensor h = save_preact ? at::empty_like(g) : g;
  glu_forward(dtype_of(x), static_cast<int>(act), g.size(0), g.size(1), mat(g), mat(u), mat(h), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Tensor y = gemm_bias(h, wd, bd);
  if (!save_preact) return {y, Tensor(), Tensor(), Tensor()};
  return {y, h, g, u};
}

// All seven gradients [dx, dWg, dWu, dWd, dbg, dbu, dbd] (undefined where not asked for) from dy and the saved g, u
// (and h, or an empty/undefined h: then it is rebuilt over dh when dWd needs it). overwrite: dg and du are written
// over g and u (the caller hands them over), so the backward allocates no [tokens, hidden] buffer but dh.
std::vector<Tensor> gated_mlp_backward(const Tensor& dy, const Tensor& x, const Tensor& wg, const Tensor& wu,
                                       const Tensor& wd, const Tensor& g_in, const Tensor& u_in, const OptTensor& h_in,
                                       int64_t act, bool overwrite, bool need_dx, bool need_dw, bool need_dbg,
                                       bool need_dbu, bool need_dbd) {
  check_gated(x, wg, wu, wd, std::nullopt, std::nullopt, std::nullopt);
  check_act(act);
  const int64_t m = x.size(0), dim = x.size(1), hidden = wg.size(0);
  check_like("dy", dy, x, {m, dim});
  check_like("g", g_in, x, {m, hidden});
  check_like("u", u_in, x, {m, hidden});
  const bool have_h = given(h_in) && h_in->numel() > 0;
  if (have_h) check_like("h", *h_in, x, {m, hidden});
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor g = unit_cols(g_in), u = unit_cols(u_in);
  const bool in_place = overwrite && g.is_same(g_in) && u.is_same(u_in);
  Tensor dg = in_place ? g : at::empty({m, hidden}, x.options());
  Tensor du = in_place ? u : at::empty({m, hidden}, x.options());
  Tensor dh = at::mm(dy, wd);
  const bool rebuild_h = !have_h && need_dw;
  Tensor sums = (need_dbg || need_dbu) ? at::zeros({2, hidden}, x.options().dtype(at::kFloat)) : Tensor();
  glu_backward(dtype_of(x), static_cast<int>(act), m, hidden, mat(dh), mat(g), mat(u), mat(dg), mat(du),
               rebuild_h ? mat(dh) : Mat{nullptr, 0}, sums.defined() ? sums[0].data_ptr<float>() : nullptr,
               sums.defined() ? sums[1].data_ptr<float>() : nullptr, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  g.reset();
  u.reset();
  Tensor h = have_h ? *h_in : dh;  // rebuilt over dh, each element after its read
  dh.reset();
  Tensor dx, dwg, dwu, dwd, dbg, dbu, dbd;
  if (need_dw) dwd = at::mm(dy.t(), h);
  h.reset();
  if (need_dx) dx = at::mm(dg, wg).addmm_(du, wu);
  if (need_dbg) dbg = sums[0].to(x.scalar_type());
  if (need_dbu) dbu = sums[1].to(x.scalar_type());
  if (need_dbd) dbd = dy.sum(0, false, at::kFloat).to(x.scalar_type());
  if (need_dw) {
    dwu = at::mm(du.t(), x);
    du.reset();  // released before the last GEMM, as the other backends do
    dwg = at::mm(dg.t(), x);
  }
  return {dx, dwg, dwu, dwd, dbg, dbu, dbd};
}

// y = act(x·Wᵀ + b). Returns [y, z] with z = x·Wᵀ + b when save_preact and there is an activation (else undefined).
// cuBLASLt's epilogues cover bias + GELU(tanh) and bias + ReLU in the GEMM itself; the other activations (and the
// no-bias case, where ATen has no epilogue to use) take one GEMM plus one bias + activation pass.
std::vector<Tensor> linear_act_forward(const Tensor& x, const Tensor& w, const OptTensor& b, int64_t act,
                                       bool save_preact) {
  check_lead("x", x, 2);
  TORCH_CHECK_VALUE(w.defined() && w.dim() == 2, "weight: expected a 2-D [out_features, in_features] tensor");
  check_like("weight", w, x, {w.size(0), x.size(1)});
  check_opt("bias", b, x, w.size(0));
  check_act(act);
  const c10::cuda::CUDAGuard guard(x.device());
  if (act == IDENTITY) return {gemm_bias(x, w, b), Tensor()};
  if (!save_preact && given(b) && (act == GELU_TANH || act == RELU)) {
    return {at::_addmm_activation(*b, x, w.t(), 1, 1, /*use_gelu=*/act == GELU_TANH), Tensor()};
  }
  if (save_preact) {
    Tensor z = gemm_bias(x, w, b);
    Tensor y = at::empty_like(z);
    bias_act(dtype_of(x), static_cast<int>(act), z.size(0), z.size(1), mat(z), nullptr, mat(y), stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {y, z};
  }
  Tensor y = at::mm(x, w.t());  // bias and activation in one pass over it, in place
  bias_act(dtype_of(x), static_cast<int>(act), y.size(0), y.size(1), mat(y), ptr_or_null(b), mat(y), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, Tensor()};
}

// The GLU kernels alone (benchmarks and tests time and check them without the GEMMs around them).
Tensor glu_forward_op(const Tensor& g, const Tensor& u, int64_t act) {
  check_lead("g", g, 2);
  check_like("u", u, g, {g.size(0), g.size(1)});
  check_act(act);
  const c10::cuda::CUDAGuard guard(g.device());
  Tensor gc = unit_cols(g), uc = unit_cols(u);
  Tensor h = at::empty(g.sizes(), g.options());
  glu_forward(dtype_of(g), static_cast<int>(act), g.size(0), g.size(1), mat(gc), mat(uc), mat(h), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return h;
}

// [dg, du, h (want_h), dbg, dbu (bias_sums, fp32)].
std::vector<Tensor> glu_backward_op(const Tensor& dh, const Tensor& g, const Tensor& u, int64_t act, bool want_h,
                                    bool bias_sums) {
  check_lead("dh", dh, 2);
  check_like("g", g, dh, {dh.size(0), dh.size(1)});
  check_like("u", u, dh, {dh.size(0), dh.size(1)});
  check_act(act);
  const c10::cuda::CUDAGuard guard(dh.device());
  Tensor dhc = unit_cols(dh), gc = unit_cols(g), uc = unit_cols(u);
  Tensor dg = at::empty(dh.sizes(), dh.options()), du = at::empty(dh.sizes(), dh.options());
  Tensor h = want_h ? at::empty(dh.sizes(), dh.options()) : Tensor();
  Tensor sums = bias_sums ? at::zeros({2, dh.size(1)}, dh.options().dtype(at::kFloat)) : Tensor();
  glu_backward(dtype_of(dh), static_cast<int>(act), dh.size(0), dh.size(1), mat(dhc), mat(gc), mat(uc), mat(dg),
               mat(du), want_h ? mat(h) : Mat{nullptr, 0}, bias_sums ? sums[0].data_ptr<float>() : nullptr,
               bias_sums ? sums[1].data_ptr<float>() : nullptr, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dg, du, h, bias_sums ? sums[0] : Tensor(), bias_sums ? sums[1] : Tensor()};
}

}  // namespace mlpfuse

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mlpfuse's CUDA backend (cuBLAS(Lt) GEMMs through ATen + hand-written GLU and decode kernels)";
  m.def("gated_mlp_forward", &mlpfuse::gated_mlp_forward);
  m.def("gated_mlp_backward", &mlpfuse::gated_mlp_backward);
  m.def("linear_act_forward", &mlpfuse::linear_act_forward);
  m.def("glu_forward", &mlpfuse::glu_forward_op);
  m.def("glu_backward", &mlpfuse::glu_backward_op);
  m.attr("decode_max_m") = mlpfuse::kDecodeMaxM;
}
