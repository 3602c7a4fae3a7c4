// Launchers of mlpfuse's hand-written CUDA kernels. Plain C++ types only, so that the .cu files need no torch headers
// (they compile in seconds) and mlpfuse_cuda.cpp, which does all tensor checks, needs no CUDA compiler.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mlpfuse {

// Element types, as the .cpp names them after checking the tensors.
enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Activation ids: the same integers as mlpfuse.activations (IDENTITY .. QUICK_GELU).
enum Act : int { IDENTITY = 0, GELU_TANH = 1, GELU = 2, SILU = 3, RELU = 4, RELU2 = 5, QUICK_GELU = 6 };

// A row-major matrix view: element (r, c) is at ptr[r * ld + c]. Column stride 1 is required (the .cpp ensures it).
struct Mat {
  void* ptr;
  int64_t ld;
};

// h = act(g) * u over [rows, cols]. h may alias g or u.
void glu_forward(DType dtype, int act, int64_t rows, int64_t cols, Mat g, Mat u, Mat h, cudaStream_t stream);

// dg = dh * u * act'(g), du = dh * act(g), and h = act(g) * u when h.ptr is set. dg may alias g, du may alias u and
// h may alias dh: each element is read and written by the same thread. With dbg/dbu set (fp32 [cols], zeroed by the
// caller), the column sums of dg and du are added there before rounding.
void glu_backward(DType dtype, int act, int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h,
                  float* dbg, float* dbu, cudaStream_t stream);

// y = act(z + bias) over [rows, cols]; bias (length cols) may be null; y may alias z.
void bias_act(DType dtype, int act, int64_t rows, int64_t cols, Mat z, const void* bias, Mat y, cudaStream_t stream);

// Whether the decode kernel can run these sizes and pointers (16-byte vectors everywhere); the caller falls back to
// the GEMM path otherwise.
bool decode_supported(DType dtype, int64_t m, int64_t dim, int64_t hidden, const void* const* ptrs, int n_ptrs,
                      const int64_t* lds, int n_lds);
constexpr int64_t kDecodeMaxM = 16;

// The whole gated MLP for m <= kDecodeMaxM tokens, as two launches: h = act(x·Wgᵀ + bg)·(x·Wuᵀ + bu) into h
// ([m, hidden], the input dtype, written here), then y = h·Wdᵀ + bd. Deterministic (no atomics).
void decode_gated_mlp(DType dtype, int act, int64_t m, int64_t dim, int64_t hidden, Mat x, Mat wg, Mat wu, Mat wd,
                      const void* bg, const void* bu, const void* bd, Mat h, Mat y, cudaStream_t stream);

}  // namespace mlpfuse
