// The decode kernels' shared pieces: the launch shapes, the tensor-core weight-streaming kernel and its helpers, used
// by decode.cu (the kernels in use; its opening comment explains the design) and decode_variants.cu (alternative
// shapes of kernel 2, selectable for measurement only).
#pragma once

#include <type_traits>

#include "common.cuh"

namespace mlpfuse {
namespace {

constexpr int kTileRows = 16;  // the mma's M

// The launch shape of each kernel (NMAT weight matrices, NT tiles of 8 tokens): warps per block, each taking an
// interleaved share of k; 16-row tiles per warp (RT); 16-byte vectors per weight row and lane in flight per iteration
// (U); blocks per SM the registers are sized for. Bytes in flight per SM, not instructions, set the bandwidth, and
// the registers set the bytes in flight; at hidden 14336, dim 4096 (ptxas, sm_90):
//   kernel 1 (two matrices, hidden / 16 blocks: 896) is sized so that all of its blocks fit on the SMs at once (at 8
//     warps it took 1.7 waves, 2.3 at 16 tokens, and the last, partial wave streamed at a fraction of the
//     bandwidth). Up to 8 tokens: 4 warps, U = 2 (64 registers, 8 blocks per SM), 4 KiB per warp, 110 KiB per SM.
//     At 16 tokens the second token tile's B fragments and accumulators cost 16 registers more per lane: 3 warps of
//     U = 2 (80 registers) kept only 81 KiB per SM; 2 warps of U = 4 (7 blocks per SM, 8 KiB per warp) keep 109.
//   kernel 2 (one matrix, dim / 16 blocks: 256, one wave either way) gives its few blocks more bytes each: 8 warps,
//     U = 8 (120 registers, 2 blocks per SM), 64 KiB per block, 128 KiB per SM. At 16 tokens a warp's h fragments
//     are as many bytes as its Wd fragments: with 16 rows per block every block reads all of h (m·hidden) from L2,
//     as many bytes as the Wd it streams, and the SMs took twice the weight bytes through L2. A warp there takes two
//     16-row tiles against one set of h fragments (RT = 2): h costs half the weight bytes, as at 8 tokens. 16 warps
//     of U = 3 (128 registers, one 32-row block per SM) keep 96 KiB per SM, as the 16-row blocks of U = 6 did.
// kSplit: CTAs of a cluster that share the block's rows, each taking an interleaved share of k (1: a block reduces
// over all of k; more only in decode_variants.cu).
template <int NMAT, int NT>
struct Shape {
  static constexpr int kWarps = NMAT == 2 ? (NT == 1 ? 4 : 2) : (NT == 1 ? 8 : 16);
  static constexpr int kRowTiles = NMAT == 1 && NT == 2 ? 2 : 1;
  static constexpr int kUnroll = NMAT == 2 ? (NT == 1 ? 2 : 4) : (NT == 1 ? 8 : 3);
  static constexpr int kBlocksPerSM = NMAT == 2 ? (NT == 1 ? 8 : 7) : (NT == 1 ? 2 : 1);
  static constexpr int kSplit = 1;
};

// One of the two kernels: out[t, r] over r < rows, t < m, reducing over k.
struct GemvArgs {
  int m;            // tokens, 1..16
  int act;          // with two weight matrices: the activation of the first
  int64_t k, rows;  // reduction length; output features
  Mat w0, w1;       // [rows, k]; w1 only with two matrices (up projection)
  Mat in;           // [m, k]
  const void* b0;   // [rows] or null
  const void* b1;
  Mat out;          // [m, rows]
};

__device__ __forceinline__ float act_rt(int act, float x) {  // once per output: a switch is fine here
  switch (act) {
    case GELU_TANH: return act_fwd<GELU_TANH>(x);
    case GELU: return act_fwd<GELU>(x);
    case SILU: return act_fwd<SILU>(x);
    case RELU: return act_fwd<RELU>(x);
    case RELU2: return act_fwd<RELU2>(x);
    default: return x;
  }
}

// A weight vector: read once, so it does not displace x or h from L1.
__device__ __forceinline__ uint4 load_weights(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 load_input(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// c += A·B for one m16n8k16 tile, fp32 accumulation.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(Mat w, int64_t r) {
  return static_cast<const T*>(w.ptr) + r * w.ld;
}

// The block's ROWS output rows from the per-warp partial sums part[warp][matrix][row][token]: summed in warp order
// (the same bits every run), biased, and for two matrices combined as act(g)·u; rounded once into out.
template <typename T, int WARPS, int NMAT, int ROWS, int MT>
__device__ __forceinline__ void finish(const GemvArgs& p, int64_t row0, const float (*part)[NMAT][ROWS][MT]) {
  for (int i = threadIdx.x; i < ROWS * MT; i += WARPS * 32) {
    const int r = i % ROWS, t = i / ROWS;  // consecutive threads: consecutive rows, contiguous stores
    const int64_t row = row0 + r;
    if (t >= p.m || row >= p.rows) continue;
    float s[NMAT];
#pragma unroll
    for (int mat = 0; mat < NMAT; ++mat) {
      s[mat] = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s[mat] += part[w][mat][r][t];
    }
    float v = s[0] + (p.b0 ? to_float(static_cast<const T*>(p.b0)[row]) : 0.0f);
    if constexpr (NMAT == 2) {
      const float u = s[1] + (p.b1 ? to_float(static_cast<const T*>(p.b1)[row]) : 0.0f);
      v = act_rt(p.act, v) * u;
    }
    static_cast<T*>(p.out.ptr)[t * p.out.ld + row] = from_float<T>(v);
  }
}

// Thread-block clusters (sm_90), for the split shapes of decode_variants.cu.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

__device__ __forceinline__ unsigned cluster_size() {
  unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}

// The split shapes' finish: SPLIT CTAs of a cluster each reduced an interleaved share of k for the same ROWS rows.
// Each folds its warps into its own total (in warp order); after a cluster barrier CTA rank q finishes rows
// [q·ROWS/SPLIT, (q+1)·ROWS/SPLIT), summing every CTA's total through distributed shared memory in rank order: one
// fixed order of additions per output, so the same bits on every run, and no atomics. A second barrier keeps each
// CTA's total alive until the others have read it.
template <typename T, int WARPS, int ROWS, int MT, int SPLIT>
__device__ __forceinline__ void finish_split(const GemvArgs& p, int64_t row0, const float (*part)[1][ROWS][MT],
                                             unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(ROWS % SPLIT == 0, "each CTA finishes the same number of rows");
  __shared__ float total[ROWS][MT];
  for (int i = threadIdx.x; i < ROWS * MT; i += WARPS * 32) {
    const int r = i / MT, t = i % MT;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += part[w][0][r][t];
    total[r][t] = s;
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  constexpr int kOwn = ROWS / SPLIT;
  for (int i = threadIdx.x; i < kOwn * MT; i += WARPS * 32) {
    const int r = static_cast<int>(rank) * kOwn + i % kOwn, t = i / kOwn;  // consecutive threads: consecutive rows
    const int64_t row = row0 + r;
    if (t >= p.m || row >= p.rows) continue;
    const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(&total[r][t]));
    float s = 0.0f;
#pragma unroll
    for (unsigned src = 0; src < SPLIT; ++src) {
      uint32_t remote;
      float v;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(src));
      asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
      s += v;
    }
    const float v = s + (p.b0 ? to_float(static_cast<const T*>(p.b0)[row]) : 0.0f);
    static_cast<T*>(p.out.ptr)[t * p.out.ld + row] = from_float<T>(v);
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();  // launched only on sm_90 devices
#endif
}

// 16-bit inputs, tensor cores. NT: tiles of 8 tokens (1 for m <= 8, else 2); the rest of the launch shape is
// S (Shape<NMAT, NT> unless a variant is measured): a warp holds RT tiles of 16 weight rows (the block's 16·RT rows) against the same B fragments, and
// U 16-byte vectors per weight row and lane are in flight per iteration.
//
// Lane (g, q) = (lane / 4, lane % 4) holds A rows g and g + 8 of each row tile and B column (token) g, at k positions 2q, 2q + 1,
// 2q + 8, 2q + 9 of each k16 step. It loads 8 contiguous elements e0..e7 of its rows and of its token's x at
// k0 + 8q and uses (e0 e1 | e2 e3) as the first k16 step's (2q, 2q+1 | 2q+8, 2q+9) and (e4 e5 | e6 e7) as the
// second's: a permutation of k, the same for A and B, which the sum over k does not see.
//
// Kernel 1 lets kernel 2 launch at once (grid_dependents_may_launch) and kernel 2 is launched as its programmatic
// dependent: kernel 2's blocks take the SMs that kernel 1's finishing blocks leave, load their first iteration of
// Wd (which kernel 1 does not write) and only then wait for h. That hides the launch gap and the first round trip
// of kernel 2 behind kernel 1's tail. Kernel 1 itself is launched the ordinary way: the weights it streams before
// anything else could have been written by the kernel before it.
template <typename T, int NMAT, int NT, typename S = Shape<NMAT, NT>>
__global__ void __launch_bounds__(S::kWarps * 32, S::kBlocksPerSM) decode_gemv_mma_kernel(GemvArgs p) {
  constexpr int WARPS = S::kWarps, RT = S::kRowTiles, U = S::kUnroll, SPLIT = S::kSplit;
  static_assert(SPLIT == 1 || NMAT == 1, "only kernel 2 splits k over a cluster");
  constexpr int ROWS = kTileRows * RT, MT = NT * 8;
  constexpr int kStep = 32;  // k covered by one vector of each of the 4 lanes of a row
  __shared__ float part[WARPS][NMAT][ROWS][MT];
  if constexpr (NMAT == 2) grid_dependents_may_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x / SPLIT) * ROWS;  // a cluster's CTAs are consecutive in x
  unsigned rank = 0;  // this CTA's share of k within its cluster
  if constexpr (SPLIT > 1) {
    if (cluster_size() != SPLIT) __trap();  // launched without the cluster this shape needs
    rank = cluster_rank();
  }

  // Rows past the end read the last row (never stored) rather than branch around the loads. w[mat][2·tile + h]:
  // row g + 8h of the tile.
  const T* w[NMAT][2 * RT];
#pragma unroll
  for (int h = 0; h < 2 * RT; ++h) {
    const int64_t r = min(row0 + g + 8 * h, p.rows - 1);
    w[0][h] = row_ptr<T>(p.w0, r);
    if constexpr (NMAT == 2) w[NMAT - 1][h] = row_ptr<T>(p.w1, r);
  }
  const T* xr[NT];
  bool has_token[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    has_token[n] = n * 8 + g < p.m;
    xr[n] = row_ptr<T>(p.in, has_token[n] ? n * 8 + g : 0);
  }

  float acc[NMAT][RT][NT][4] = {};
  // One iteration: U vectors per weight row and lane, all loads issued before the first mma. CHECKED: the last,
  // partial chunk of k, where a lane's vector may lie past the end (then it counts as zeros). Tokens past m read
  // token 0 (an L1 hit) and are zeroed by a select rather than a branch, which would keep the loads apart.
  // WAIT: the first iteration, whose weight loads go out before the wait for the kernel that wrote the input.
  auto step = [&](int64_t kb, auto checked, auto wait) {
    constexpr bool CHECKED = decltype(checked)::value;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 a[NMAT][2 * RT][U], b[NT][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = kb + u * kStep + 8 * q;
      const bool ok = !CHECKED || k < p.k;  // k and p.k are multiples of 8: a vector is wholly in or out
#pragma unroll
      for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
        for (int h = 0; h < 2 * RT; ++h) a[mat][h][u] = ok ? load_weights(w[mat][h] + k) : zero;
      }
    }
    if constexpr (decltype(wait)::value) grid_dependency_wait();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = kb + u * kStep + 8 * q;
      const bool ok = !CHECKED || k < p.k;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const uint4 v = ok ? load_input(xr[n] + k) : zero;
        b[n][u] = has_token[n] ? v : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const uint4 &lo = a[mat][2 * rt][u], &hi = a[mat][2 * rt + 1][u], &x = b[n][u];
            mma16816<T>(acc[mat][rt][n], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
            mma16816<T>(acc[mat][rt][n], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
          }
        }
      }
    }
  };
  constexpr int64_t kChunk = int64_t(kStep) * U;  // k per warp and iteration
  constexpr int64_t kStride = int64_t(WARPS) * SPLIT * kChunk;  // chunks interleave over the cluster's warps
  int64_t kb = (int64_t(warp) * SPLIT + rank) * kChunk;
  if constexpr (NMAT == 1) {  // kernel 2: the first iteration's weights before the wait for h
    if (kb < p.k) {
      step(kb, std::true_type{}, std::true_type{});
      kb += kStride;
    } else {
      grid_dependency_wait();
    }
  }
  for (; kb + kChunk <= p.k; kb += kStride) step(kb, std::false_type{}, std::false_type{});
  if (kb < p.k) step(kb, std::true_type{}, std::false_type{});
  // Accumulator fragment: c0, c1 at row g of the tile, tokens 2q, 2q + 1; c2, c3 at row g + 8.
#pragma unroll
  for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      const int r = kTileRows * rt + g;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        part[warp][mat][r][n * 8 + 2 * q] = acc[mat][rt][n][0];
        part[warp][mat][r][n * 8 + 2 * q + 1] = acc[mat][rt][n][1];
        part[warp][mat][r + 8][n * 8 + 2 * q] = acc[mat][rt][n][2];
        part[warp][mat][r + 8][n * 8 + 2 * q + 1] = acc[mat][rt][n][3];
      }
    }
  }
  __syncthreads();
  if constexpr (SPLIT == 1) finish<T, WARPS, NMAT, ROWS, MT>(p, row0, part);
  else finish_split<T, WARPS, ROWS, MT, SPLIT>(p, row0, part, rank);
}

template <typename... Params>
void launch(void (*kernel)(Params...), unsigned blocks, unsigned threads, bool dependent, cudaStream_t stream,
            const GemvArgs& p) {
  if (dependent) launch_dependent(kernel, dim3(blocks), dim3(threads), stream, p);
  else kernel<<<blocks, threads, 0, stream>>>(p);
}

}  // namespace
}  // namespace mlpfuse
