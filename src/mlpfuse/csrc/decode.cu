// The whole gated MLP for decode-sized batches (m <= 16 tokens), on CUDA cores:
//
//     y = down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd        x [m, dim], Wg/Wu [hidden, dim], Wd [dim, hidden]
//
// At a few tokens the MLP is bound by reading its 3·hidden·dim weights once; everything else (launches, the
// [m, hidden] intermediates) is overhead. Each block owns a slice of kSlice hidden units and reads its weights
// exactly once:
//   phase 1  every warp takes 8 of the slice's hidden rows, two at a time, and streams the Wg and Wu rows in
//            16-byte vectors against x (tiny, L1/L2-resident), accumulating g and u for all tokens in fp32
//            registers; a warp shuffle sums the lanes, and h = act(g + bg)·(u + bu), rounded to the input dtype as
//            the unfused path rounds it, goes to shared memory;
//   phase 2  the block streams Wd[:, slice] (kSlice contiguous elements per output row) against h and adds its
//            partial of y to an fp32 accumulator with atomics.
// A second, tiny kernel casts the accumulator (+ bd) into y. The atomics make the last bits of y vary run to run;
// the C++ entry takes the GEMM path instead under torch.use_deterministic_algorithms(True).
#include <algorithm>

#include "common.cuh"

namespace mlpfuse {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSlice = 64;                  // hidden units per block: 8 warps × 8 rows
constexpr int kRowsPerWarp = kSlice / kWarps;

__device__ __forceinline__ float act_rt(int act, float x) {  // once per (token, hidden unit): a switch is fine here
  switch (act) {
    case GELU_TANH: return act_fwd<GELU_TANH>(x);
    case GELU: return act_fwd<GELU>(x);
    case SILU: return act_fwd<SILU>(x);
    case RELU: return act_fwd<RELU>(x);
    case RELU2: return act_fwd<RELU2>(x);
    default: return x;
  }
}

__device__ __forceinline__ float warp_sum(float v, int width = 32) {
#pragma unroll
  for (int off = width / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// MT: the token count rounded up to a power of two (the accumulators' size must be known at compile time).
template <typename T, int MT>
__global__ void __launch_bounds__(kThreads) decode_mlp_kernel(int act, int m, int64_t dim, int64_t hidden, Mat x,
                                                              Mat wg, Mat wu, Mat wd, const T* bg, const T* bu,
                                                              float* acc) {
  constexpr int V = kVec<T>;
  __shared__ float hs[MT][kSlice];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t slice0 = int64_t(blockIdx.x) * kSlice;
  const T* xp = static_cast<const T*>(x.ptr);

  // Phase 1: two hidden rows per pass, so each x vector loaded feeds 4 weight vectors.
  for (int p = 0; p < kRowsPerWarp; p += 2) {
    const int local = warp * kRowsPerWarp + p;
    const int64_t j = slice0 + local;  // j and j + 1; hidden is a multiple of V >= 4, so both exist or neither
    if (j >= hidden) {
      for (int t = lane; t < MT * 2; t += 32) hs[t / 2][local + t % 2] = 0.0f;
      continue;
    }
    float a[2][2][MT] = {};  // [row][gate, up][token]
    const T* g0 = static_cast<const T*>(wg.ptr) + j * wg.ld;
    const T* u0 = static_cast<const T*>(wu.ptr) + j * wu.ld;
    for (int64_t c = int64_t(lane) * V; c < dim; c += 32 * V) {
      float w[2][2][V];
      load_vec<T, V>(g0 + c, w[0][0]);
      load_vec<T, V>(u0 + c, w[0][1]);
      load_vec<T, V>(g0 + wg.ld + c, w[1][0]);
      load_vec<T, V>(u0 + wu.ld + c, w[1][1]);
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        if (t >= m) break;
        float xv[V];
        load_vec<T, V>(xp + t * x.ld + c, xv);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          a[0][0][t] += w[0][0][i] * xv[i];
          a[0][1][t] += w[0][1][i] * xv[i];
          a[1][0][t] += w[1][0][i] * xv[i];
          a[1][1][t] += w[1][1][i] * xv[i];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float bgr = bg ? to_float(bg[j + r]) : 0.0f, bur = bu ? to_float(bu[j + r]) : 0.0f;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const float g = warp_sum(a[r][0][t]) + bgr, u = warp_sum(a[r][1][t]) + bur;
        if (lane == 0) hs[t][local + r] = t < m ? to_float(from_float<T>(act_rt(act, g) * u)) : 0.0f;
      }
    }
  }
  __syncthreads();

  // Phase 2: kLanes lanes read one row of Wd[:, slice] (kSlice·sizeof(T) contiguous bytes), each one 16-byte vector.
  constexpr int kLanes = kSlice / V;
  constexpr int kRowsPerPass = kThreads / kLanes;
  const int sub = threadIdx.x % kLanes;
  const int64_t col = slice0 + int64_t(sub) * V;
  const bool has_col = col < hidden;
  // Every lane runs the same number of passes (the shuffles need the whole warp); rows past dim only skip memory.
  for (int64_t d0 = 0; d0 < dim; d0 += kRowsPerPass) {
    const int64_t d = d0 + threadIdx.x / kLanes;
    const bool has_row = d < dim;
    float w[V] = {};
    if (has_row && has_col) load_vec<T, V>(static_cast<const T*>(wd.ptr) + d * wd.ld + col, w);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (t >= m) break;
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < V; ++i) s += w[i] * hs[t][sub * V + i];
      // The kLanes lanes of a row are adjacent: an xor shuffle below kLanes stays inside the row.
#pragma unroll
      for (int off = kLanes / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (sub == 0 && has_row) atomicAdd(acc + t * dim + d, s);
    }
  }
}

template <typename T>
__global__ void decode_finalize_kernel(int64_t m, int64_t dim, const float* acc, const T* bd, Mat y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * dim) return;
  const int64_t t = i / dim, d = i % dim;
  static_cast<T*>(y.ptr)[t * y.ld + d] = from_float<T>(acc[i] + (bd ? to_float(bd[d]) : 0.0f));
}

template <typename T, int MT>
void launch(int act, int64_t m, int64_t dim, int64_t hidden, Mat x, Mat wg, Mat wu, Mat wd, const T* bg, const T* bu,
            float* acc, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((hidden + kSlice - 1) / kSlice);
  decode_mlp_kernel<T, MT><<<blocks, kThreads, 0, stream>>>(act, static_cast<int>(m), dim, hidden, x, wg, wu, wd, bg,
                                                            bu, acc);
}

}  // namespace

bool decode_supported(DType dtype, int64_t m, int64_t dim, int64_t hidden, const void* const* ptrs, int n_ptrs,
                      const int64_t* lds, int n_lds) {
  const int v = dtype == DType::f32 ? 4 : 8;
  if (m < 1 || m > kDecodeMaxM || dim % v != 0 || hidden % v != 0) return false;
  for (int i = 0; i < n_ptrs; ++i) {
    if (ptrs[i] != nullptr && !aligned16(ptrs[i])) return false;
  }
  for (int i = 0; i < n_lds; ++i) {
    if (lds[i] % v != 0) return false;
  }
  // 2^31 blocks are far away; the grid's x dimension allows that many.
  return (hidden + kSlice - 1) / kSlice < (int64_t(1) << 31);
}

void decode_gated_mlp(DType dtype, int act, int64_t m, int64_t dim, int64_t hidden, Mat x, Mat wg, Mat wu, Mat wd,
                      const void* bg, const void* bu, const void* bd, float* acc, Mat y, cudaStream_t stream) {
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const T* g = static_cast<const T*>(bg);
    const T* u = static_cast<const T*>(bu);
    if (m <= 1) launch<T, 1>(act, m, dim, hidden, x, wg, wu, wd, g, u, acc, stream);
    else if (m <= 2) launch<T, 2>(act, m, dim, hidden, x, wg, wu, wd, g, u, acc, stream);
    else if (m <= 4) launch<T, 4>(act, m, dim, hidden, x, wg, wu, wd, g, u, acc, stream);
    else if (m <= 8) launch<T, 8>(act, m, dim, hidden, x, wg, wu, wd, g, u, acc, stream);
    else launch<T, 16>(act, m, dim, hidden, x, wg, wu, wd, g, u, acc, stream);
    const int64_t n = m * dim;
    decode_finalize_kernel<T><<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
        m, dim, acc, static_cast<const T*>(bd), y);
  });
}

}  // namespace mlpfuse
