// The whole gated MLP for decode-sized batches (m <= 16 tokens):
//
//     y = down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd        x [m, dim], Wg/Wu [hidden, dim], Wd [dim, hidden]
//
// At a few tokens the MLP is bound by reading its 3·hidden·dim weights once, so the design is about keeping HBM
// busy and everything else off the critical path:
//   * two kernels of one shape (decode_gemv): a block owns 16 output rows (32 in kernel 2 at 16 tokens) and
//     reduces over the whole k range itself, its warps each taking an interleaved share of k and meeting in shared
//     memory. Kernel 1 streams the Wg and Wu rows of 16 hidden units and writes h = act(g + bg)·(u + bu), rounded
//     to the input dtype as the unfused path rounds it, to a [m, hidden] buffer (tiny); kernel 2 streams rows of Wd
//     against h and writes y (+ bd). No atomics, no zeroed accumulator (no memset launch), and the same bits on every run.
//   * the weights are read with 16-byte loads that skip L1 (read once), every load of an iteration issued before
//     the first multiply: 96–128 KiB in flight per SM (Shape below), where the single kernel's per-token dot
//     products kept about 27 KiB. Kernel 1 has hidden / 16 blocks (896 at hidden 14336), kernel 2 dim / 16 (or 32); each
//     is sized to run in a single wave, where every block streams at the same rate and all end together.
//   * kernel 2 is a programmatic dependent launch of kernel 1 (sm_90): it streams its first Wd bytes while kernel
//     1's last blocks finish, instead of starting after kernel 1 has drained and the launch gap has passed.
//   * the products run on tensor cores (mma m16n8k16, fp32 accumulation) for 16-bit inputs: a warp's 16 weight rows
//     are the A operand and up to 8 tokens of x the B operand, so the work per weight byte stays one instruction per
//     8 tokens instead of growing with m as CUDA-core dot products do (at 16 tokens those cost as long as the
//     weights take to stream). The reduction over k does not care about the order of k, so each lane loads 16
//     contiguous bytes of its weight row and the same 16 bytes of its token's x, and the pair is fed to the mma as
//     if it were the fragment's k positions: no shuffles, no shared-memory staging, no ldmatrix.
//   * fp32 inputs keep the same tiling with CUDA-core dot products (tensor cores would need TF32, which loses the
//     precision fp32 callers ask for).
#include <algorithm>
#include <type_traits>

#include "decode.cuh"

namespace mlpfuse {
namespace {

// fp32 inputs, CUDA cores, the same tiling: lane (g, q) takes rows g and g + 8 at k0 + 4q (4 elements, 16 bytes)
// against every token; the 4 lanes of a row then sum their partials with shuffles. Launched the same way as the
// mma kernels; it waits for its predecessor before its first load.
template <int NMAT, int MT>
__global__ void __launch_bounds__(Shape<NMAT, 1>::kWarps * 32) decode_gemv_fma_kernel(GemvArgs p) {
  constexpr int WARPS = Shape<NMAT, 1>::kWarps;
  constexpr int kStep = 16;
  __shared__ float part[WARPS][NMAT][kTileRows][MT];
  if constexpr (NMAT == 2) grid_dependents_may_launch();
  grid_dependency_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows;
  const float* w[NMAT][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = min(row0 + g + 8 * h, p.rows - 1);
    w[0][h] = row_ptr<float>(p.w0, r);
    if constexpr (NMAT == 2) w[NMAT - 1][h] = row_ptr<float>(p.w1, r);
  }
  const float* xp = static_cast<const float*>(p.in.ptr);
  float acc[NMAT][2][MT] = {};
  for (int64_t k = int64_t(warp) * kStep + 4 * q; k < p.k + 4 * q; k += int64_t(WARPS) * kStep) {
    if (k >= p.k) continue;  // k and p.k are multiples of 4; the lanes meet again at the shuffles below
    float4 a[NMAT][2];
#pragma unroll
    for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = load_weights(w[mat][h] + k);
        a[mat][h] = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                                __uint_as_float(v.w));
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (t >= p.m) break;
      const float4 xv = __ldg(reinterpret_cast<const float4*>(xp + t * p.in.ld + k));
#pragma unroll
      for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc[mat][h][t] += a[mat][h].x * xv.x + a[mat][h].y * xv.y + a[mat][h].z * xv.z + a[mat][h].w * xv.w;
        }
      }
    }
  }
#pragma unroll
  for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        float v = acc[mat][h][t];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (t % 4 == q) part[warp][mat][g + 8 * h][t] = v;
      }
    }
  }
  __syncthreads();
  finish<float, WARPS, NMAT, kTileRows, MT>(p, row0, part);
}

// dependent: launched as the programmatic dependent of the kernel before it (kernel 2 after kernel 1).
template <typename T, int NMAT>
void launch_gemv(const GemvArgs& p, bool dependent, cudaStream_t stream) {
  const auto blocks = [&](int rows_per_block) {
    return static_cast<unsigned>((p.rows + rows_per_block - 1) / rows_per_block);
  };
  if constexpr (std::is_same_v<T, float>) {
    constexpr unsigned threads = Shape<NMAT, 1>::kWarps * 32;
    const unsigned n = blocks(kTileRows);
    if (p.m <= 4) launch(decode_gemv_fma_kernel<NMAT, 4>, n, threads, dependent, stream, p);
    else if (p.m <= 8) launch(decode_gemv_fma_kernel<NMAT, 8>, n, threads, dependent, stream, p);
    else launch(decode_gemv_fma_kernel<NMAT, 16>, n, threads, dependent, stream, p);
  } else {
    const auto go = [&](auto nt) {
      using S = Shape<NMAT, decltype(nt)::value>;
      launch(decode_gemv_mma_kernel<T, NMAT, decltype(nt)::value>, blocks(kTileRows * S::kRowTiles), S::kWarps * 32,
             dependent, stream, p);
    };
    if (p.m <= 8) go(std::integral_constant<int, 1>{});
    else go(std::integral_constant<int, 2>{});
  }
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
  // One block per 16 output rows: the grid's x dimension allows 2^31 - 1 blocks.
  return std::max(dim, hidden) / kTileRows < (int64_t(1) << 31) - 1;
}

void decode_gated_mlp(DType dtype, int act, int64_t m, int64_t dim, int64_t hidden, Mat x, Mat wg, Mat wu, Mat wd,
                      const void* bg, const void* bu, const void* bd, Mat h, Mat y, cudaStream_t stream) {
  const int tokens = static_cast<int>(m);
  const GemvArgs up{tokens, act, dim, hidden, wg, wu, x, bg, bu, h};
  const GemvArgs down{tokens, IDENTITY, hidden, dim, wd, Mat{nullptr, 0}, h, bd, nullptr, y};
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    launch_gemv<T, 2>(up, false, stream);
    launch_gemv<T, 1>(down, true, stream);
  });
}

}  // namespace mlpfuse
