// The whole gated MLP for decode-sized batches (m <= 16 tokens):
//
//     y = down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd        x [m, dim], Wg/Wu [hidden, dim], Wd [dim, hidden]
//
// At a few tokens the MLP is bound by reading its 3·hidden·dim weights once, so the design is about keeping HBM
// busy and everything else off the critical path:
//   * two kernels of one shape (decode_gemv): a block owns 16 output rows and reduces over the whole k range
//     itself, its warps each taking a contiguous span of k and meeting in shared memory. Kernel 1 streams the Wg
//     and Wu rows of 16 hidden units and writes h = act(g + bg)·(u + bu), rounded to the input dtype as the unfused
//     path rounds it, to a [m, hidden] buffer (tiny); kernel 2 streams rows of Wd against h and writes y (+ bd). No
//     atomics, no zeroed accumulator (no memset launch), and the same bits on every run.
//   * the weights are read with 16-byte loads that skip L1 (read once), every weight load of an iteration issued
//     before the first multiply: 64–128 KiB in flight per SM (Shape below), where the single kernel's per-token dot
//     products kept about 27 KiB. Kernel 1 has hidden / 16 blocks (896 at hidden 14336), kernel 2 dim / 16; each is
//     sized to run in a single wave, where every block streams at the same rate and all end together.
//   * on sm_90 both kernels stream their weights through shared memory instead, so that their bytes stay in flight
//     while the warps multiply: kernel 1 (decode_gate_up_tma_kernel) as tensor copies of Wg's, Wu's and x's boxes
//     per stage, kernel 2 (decode_gemv_bulk_kernel) as one bulk copy per row and stage; both complete on mbarriers.
//   * kernel 2 is a programmatic dependent launch of kernel 1 (sm_90): it streams its first Wd bytes while kernel
//     1's last blocks finish, instead of starting after kernel 1 has drained and the launch gap has passed.
//   * the products run on tensor cores (mma m16n8k16, fp32 accumulation) for 16-bit inputs: a warp's 16 weight rows
//     are the A operand and up to 8 tokens of x the B operand, so the work per weight byte stays one instruction per
//     8 tokens instead of growing with m as CUDA-core dot products do (at 16 tokens those cost as long as the
//     weights take to stream). The reduction over k does not care about the order of k, so each lane reads 16
//     contiguous bytes of its weight row and the same 16 bytes of its token's x (from global memory, or on sm_90
//     from the stage in shared memory), and the pair is fed to the mma as if it were the fragment's k positions: no
//     shuffles, no ldmatrix.
//   * fp32 inputs keep the same tiling with CUDA-core dot products (tensor cores would need TF32, which loses the
//     precision fp32 callers ask for).
#include <cuda.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace mlpfuse {
namespace {

constexpr int kTileRows = 16;  // the mma's M

// The launch shape of each kernel (NMAT weight matrices, NT tiles of 8 tokens): warps per block, each taking a
// span of k; 16-row tiles per warp (RT); 16-byte vectors per weight row and lane in flight per iteration
// (U); blocks per SM the registers are sized for; whether a warp loads one tile of 8 tokens' x (or h) fragments
// at a time, multiplying it before it loads the next. At hidden 14336, dim 4096 (ptxas, sm_90; times from
// benchmarks/decode_shapes.cu on an H200, benchmarks/results/nvidia-h200/cuda-backend/decode-shapes):
//   kernel 1 (two matrices, hidden / 16 blocks: 896) is sized so that all of its blocks fit on the SMs at once (at 8
//     warps it took 1.7 waves, 2.3 at 16 tokens, and the last, partial wave streamed at a fraction of the
//     bandwidth). Up to 8 tokens: 4 warps, U = 2 (64 registers, 8 blocks per SM), 4 KiB per warp, 110 KiB per SM.
//     At 16 tokens the second token tile's B fragments and accumulators cost 16 registers more per lane. Holding
//     both tiles' fragments, 2 warps of U = 3 (8 blocks per SM, 6 KiB per warp) streamed Wg and Wu 1.1–1.6 µs
//     faster than U = 4 (7 blocks per SM, 8 KiB per warp) in each of four runs on four machines; loading one token
//     tile's fragments at a time into the same registers (kTileAtATime) lets U = 4 keep its 8 KiB in flight: 63.8
//     µs against 64.8–65.2 (U = 3) and 65.8 (U = 4) in two runs on one machine, all level (62.1–62.9) on another.
//     4 warps of U = 2 (which spill at 7 blocks per SM) took 75, 32-row blocks (RT = 2) 82–86.
//   kernel 2 (one matrix, dim / 16 blocks: 256, one wave either way) gives its few blocks more bytes each: 8 warps,
//     U = 8 (120 registers, 2 blocks per SM), 64 KiB per block, 128 KiB per SM. At 16 tokens h's fragments take as
//     many registers as Wd's: holding both tiles, 8 warps of U = 4 (2 blocks per SM) streamed Wd in 33.8–34.5 µs, U
//     = 3, 5 and 6 in 34.5–35.6; one tile at a time, U = 6 (128 registers) fits and ran level alone (33.7–34.4) and
//     0.2–1.1 µs faster behind kernel 1 in four runs. 32-row blocks of 16 warps (RT = 2: each block reads h from L2
//     half as often, but needs the whole register file, so it starts only once every kernel-1 block has left its
//     SM) took 36.0–37.8.
//   Measured and dropped: asking L2 for each chunk an iteration or more ahead (sm_90's bulk prefetch) cost 1–16 µs
//   per kernel; staging the weights in shared memory through cp.async, up to 12 stages deep, so that shared
//   memory rather than registers bounds the bytes in flight, cost 1–51 µs; one kernel for the whole MLP (a block
//   streams the gate/up rows of 64 or 128 hidden units and then those columns of Wd, adding its partial outputs with
//   fp32 reductions) took 101–143 µs against the pair's 96–100.
template <int NMAT, int NT>
struct Shape {
  static constexpr int kWarps = NMAT == 2 ? (NT == 1 ? 4 : 2) : 8;
  static constexpr int kRowTiles = 1;
  static constexpr int kUnroll = NMAT == 2 ? (NT == 1 ? 2 : 4) : (NT == 1 ? 8 : 6);
  static constexpr int kBlocksPerSM = NMAT == 2 ? (NT == 1 ? 8 : 7) : 2;
  static constexpr bool kTileAtATime = NT == 2;
};

// Kernel 2 on sm_90 (decode_gemv_bulk_kernel): 8 warps, each streaming U·64 = 256 bytes of each of its 16 rows per
// stage through 2 stages of shared memory (74 KiB per block, 2 blocks per SM). Against the register kernel in its
// place, in six runs on H200s (benchmarks/decode_shapes.cu, runs 18-24): the pair 2.2-3.1 µs faster at 1 token
// (90.3-93.9 against 93.1-96.9) and 0.8-2.2 faster at 16 (94.5-96.9 against 96.0-99.1), although alone at 16 tokens
// it is 1.1-2.2 µs slower (34.9-36.3 against 33.7-34.6): it starts with its first stages in flight before it waits
// for h. 4 warps of 512-byte rows in 3 stages, 8 warps of 5 vectors, 8 warps of 128-byte rows in 5 stages, 2-D
// tensor copies of 16-row boxes, a warp per token tile at 16 tokens, loading the next chunk's h before the products
// and prefetching further chunks into L2 before the wait were all slower in the pair.
struct BulkShape {
  static constexpr int kWarps = 8, kRowTiles = 1, kUnroll = 4, kBlocksPerSM = 2, kStages = 2;
};

// Kernel 1 on sm_90 (decode_gate_up_tma_kernel): kTiles warps of 16 hidden units per block, U·64 = 128 bytes of each
// row per stage, kStages stages. Up to 8 tokens 2 warps in 5 stages (48 KiB, 4 blocks per SM), at 9-16 tokens 4
// warps in 3 stages (62 KiB, 2 blocks per SM, which leaves room for a block of kernel 2 to start beside them).
// Against the register kernel with the same kernel 2 (benchmarks/decode_shapes.cu): the pair 88.8-89.5 µs against
// 93.7-93.9 at 1-2 tokens, 90.7 against 93.7-94.4 at 4-8 and 93.5 against 96.2 at 16 on one machine (runs 31-32),
// 88.0 against 90.9 at 1 token and 93.0 against 94.7 at 16 on another (run 33). Slower: 4 warps of 256-byte rows in 2
// stages (95.0 at 16), 4 warps of 5 stages (100.0 at 16), 3-warp blocks (93.4 at 1, 96.6-99.1 at 16), and shapes
// whose shared memory leaves too few blocks per SM for one wave (2 warps of 6 stages or of 256-byte rows: 97.7-100.9
// at 1 token).
template <int NT>
struct GateUpShape {
  static constexpr int kTiles = NT == 1 ? 2 : 4, kUnroll = 2, kStages = NT == 1 ? 5 : 3, kBlocksPerSM = NT == 1 ? 4 : 2;
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
    case QUICK_GELU: return act_fwd<QUICK_GELU>(x);
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

// ROWS output rows from row0 on, from the partial sums part[i][matrix][row][token] of WARPS warps: summed in warp
// order (the same bits every run), biased, and for two matrices combined as act(g)·u; rounded once into out. THREADS
// threads share the work, tid being this one's index among them.
template <typename T, int WARPS, int NMAT, int ROWS, int MT, int THREADS = WARPS * 32>
__device__ __forceinline__ void finish(const GemvArgs& p, int64_t row0, const float (*part)[NMAT][ROWS][MT], int tid) {
  for (int i = tid; i < ROWS * MT; i += THREADS) {
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

// Lane (g, ·)'s input rows: token n·8 + g of each token tile n, or token 0 where that tile has no such token (its
// fragments are then zeroed by a select).
template <typename T, int NT>
__device__ __forceinline__ void token_rows(const GemvArgs& p, int g, const T* (&xr)[NT], bool (&has_token)[NT]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    has_token[n] = n * 8 + g < p.m;
    xr[n] = row_ptr<T>(p.in, has_token[n] ? n * 8 + g : 0);
  }
}

// Warp `warp`'s share of k: one contiguous span [begin, end) of whole chunks (only the last chunk of k can be
// partial). Spans streamed kernel 1 1–2 µs faster than interleaving the warps' chunks (warp w taking chunks w,
// w + WARPS, ..., so that a block's warps read neighbouring bytes of each row) and kernel 2 no slower. 32-bit
// offsets within a row (decode_supported keeps k at most 2^30): kernel 1 has 64 registers at 1-8 tokens.
struct Span {
  int begin, end;
};

__device__ __forceinline__ Span warp_span(int64_t k64, int chunk, int warps, int warp) {
  const int k = static_cast<int>(k64);
  const int per = ((k + chunk - 1) / chunk + warps - 1) / warps * chunk;
  return {warp * per, min(k, warp * per + per)};
}

// The warp's accumulators into part[mat][row][token] (its slice of the block's partial sums). Accumulator fragment:
// c0, c1 at row g of the tile, tokens 2q, 2q + 1; c2, c3 at row g + 8.
template <int NMAT, int RT, int NT, int ROWS, int MT>
__device__ __forceinline__ void store_partials(float (&part)[NMAT][ROWS][MT], const float (&acc)[NMAT][RT][NT][4],
                                               int g, int q) {
#pragma unroll
  for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      const int r = kTileRows * rt + g;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        part[mat][r][n * 8 + 2 * q] = acc[mat][rt][n][0];
        part[mat][r][n * 8 + 2 * q + 1] = acc[mat][rt][n][1];
        part[mat][r + 8][n * 8 + 2 * q] = acc[mat][rt][n][2];
        part[mat][r + 8][n * 8 + 2 * q + 1] = acc[mat][rt][n][3];
      }
    }
  }
}

// 16-bit inputs, tensor cores. NT: tiles of 8 tokens (1 for m <= 8, else 2); the rest of the launch shape is
// Shape<NMAT, NT>: a warp holds RT tiles of 16 weight rows (the block's 16·RT rows) against the same B fragments, and
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
//
// S: the launch shape (Shape<NMAT, NT>; benchmarks/decode_shapes.cu times others).
template <typename T, int NMAT, int NT, class S = Shape<NMAT, NT>>
__global__ void __launch_bounds__(S::kWarps * 32, S::kBlocksPerSM) decode_gemv_mma_kernel(GemvArgs p) {
  constexpr int WARPS = S::kWarps, RT = S::kRowTiles, U = S::kUnroll;
  constexpr int ROWS = kTileRows * RT, MT = NT * 8;
  constexpr int kStep = 32;  // k covered by one vector of each of the 4 lanes of a row
  __shared__ float part[WARPS][NMAT][ROWS][MT];
  if constexpr (NMAT == 2) grid_dependents_may_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * ROWS;

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
  token_rows<T, NT>(p, g, xr, has_token);

  float acc[NMAT][RT][NT][4] = {};
  // One iteration: U vectors per weight row and lane, all loads issued before the first mma. CHECKED: the last,
  // partial chunk of k, where a lane's vector may lie past the end (then it counts as zeros). Tokens past m read
  // token 0 (an L1 hit) and are zeroed by a select rather than a branch, which would keep the loads apart.
  // WAIT: the first iteration, whose weight loads go out before the wait for the kernel that wrote the input.
  auto step = [&](int64_t kb, auto checked, auto wait) {
    constexpr bool CHECKED = decltype(checked)::value;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 a[NMAT][2 * RT][U];
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
    // Token tile n's B fragments, and the products of vector u against them.
    auto inputs = [&](int n, uint4 (&bn)[U]) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = kb + u * kStep + 8 * q;
        const bool ok = !CHECKED || k < p.k;
        const uint4 v = ok ? load_input(xr[n] + k) : zero;
        bn[u] = has_token[n] ? v : zero;
      }
    };
    auto multiply = [&](int u, int n, const uint4& x) {
#pragma unroll
      for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const uint4 &lo = a[mat][2 * rt][u], &hi = a[mat][2 * rt + 1][u];
          mma16816<T>(acc[mat][rt][n], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
          mma16816<T>(acc[mat][rt][n], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
        }
      }
    };
    if constexpr (S::kTileAtATime) {  // one token tile's fragments in registers at a time
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        uint4 bn[U];
        inputs(n, bn);
#pragma unroll
        for (int u = 0; u < U; ++u) multiply(u, n, bn[u]);
      }
    } else {
      uint4 b[NT][U];
#pragma unroll
      for (int n = 0; n < NT; ++n) inputs(n, b[n]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int n = 0; n < NT; ++n) multiply(u, n, b[n][u]);
      }
    }
  };
  constexpr int64_t kChunk = int64_t(kStep) * U;  // k per warp and iteration
  const Span span = warp_span(p.k, int(kChunk), WARPS, warp);
  int kb = span.begin;
  const int kend = span.end;
  if constexpr (NMAT == 1) {  // kernel 2: the first iteration's weights before the wait for h
    if (kb < kend) {
      step(kb, std::true_type{}, std::true_type{});
      kb += kChunk;
    } else {
      grid_dependency_wait();
    }
  }
  for (; kb + kChunk <= kend; kb += kChunk) step(kb, std::false_type{}, std::false_type{});
  if (kb < kend) step(kb, std::true_type{}, std::false_type{});
  store_partials(part[warp], acc, g, q);
  __syncthreads();
  finish<T, WARPS, NMAT, ROWS, MT>(p, row0, part, threadIdx.x);
}

// The down projection's weights through shared memory (sm_90; NMAT is 1, kept so that the kernel reads as the
// register kernel it replaces). Each warp owns a ring of S::kStages stages; a stage holds U·64 bytes (the k of one
// register-kernel iteration) of each of the block's 16 rows, put there by bulk copies (one per row, issued by lane i
// for row i) that complete on the stage's mbarrier. The warp keeps every stage in flight but
// the one it multiplies, and re-issues a stage as soon as it has read it, so the bytes in flight are bounded by
// shared memory, not registers, and stay in flight while the warp multiplies. Rows lie in pairs with 64 bytes after
// each row of a pair, so that the 8 lanes of a shared-memory phase (rows g and g + 1, 16 bytes at 16q) read distinct
// banks. The products are decode_gemv_mma_kernel's at the same U, in the same order.
__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory accesses of this thread (generic proxy) ordered before later bulk copies (async proxy).
__device__ __forceinline__ void proxy_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void stage_init(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
#endif
}

// The stages' mbarriers, initialized by this thread, made visible to the copy engine.
__device__ __forceinline__ void stages_ready() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
  proxy_fence();
}

// The stage at bar completes once `bytes` have arrived (this thread's arrival is the one it waits for).
__device__ __forceinline__ void stage_expect(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void stage_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}

__device__ __forceinline__ void stage_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
#endif
}

// Before a stage is copied into again: the warp's reads of it ordered before the copy.
__device__ __forceinline__ void stage_release() {
  __syncwarp();
  proxy_fence();
}

template <int NMAT, int U>
struct BulkStage {
  static constexpr int kRowBytes = U * 64;
  static constexpr int kBytes = NMAT * 8 * (2 * kRowBytes + 64);
  // Row i of the tile within a stage.
  __host__ __device__ static constexpr int offset(int i) {
    return (i >> 1) * (2 * kRowBytes + 64) + (i & 1) * (kRowBytes + 64);
  }
};

// Shared memory of one block: the warps' rings, their mbarriers, the per-warp partial sums.
template <int NMAT, int NT, class S>
constexpr size_t bulk_smem_bytes() {
  return size_t(S::kWarps) * S::kStages * (BulkStage<NMAT, S::kUnroll>::kBytes + 8) +
         size_t(S::kWarps) * NMAT * kTileRows * NT * 8 * sizeof(float);
}

template <typename T, int NMAT, int NT, class S>
__global__ void __launch_bounds__(S::kWarps * 32, S::kBlocksPerSM) decode_gemv_bulk_kernel(GemvArgs p) {
  constexpr int WARPS = S::kWarps, U = S::kUnroll, STAGES = S::kStages;
  constexpr int ROWS = kTileRows, MT = NT * 8;
  using Stage = BulkStage<NMAT, U>;
  constexpr int kStep = 32;
  constexpr int kChunk = kStep * U;  // k per warp and stage
  static_assert(NMAT == 1 && S::kRowTiles == 1, "the down projection, one 16-row tile per block");
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * ROWS;
  unsigned char* ring = smem + size_t(warp) * STAGES * Stage::kBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + size_t(WARPS) * STAGES * Stage::kBytes) + warp * STAGES;
  auto part = reinterpret_cast<float(*)[NMAT][ROWS][MT]>(smem + size_t(WARPS) * STAGES * (Stage::kBytes + 8));

  // Lane i < 16 copies row i of the tile (rows past the end: the last row, never stored).
  const T* src = nullptr;
  if (lane < kTileRows) src = row_ptr<T>(p.w0, min(row0 + lane, p.rows - 1));
  const uint32_t ring_addr = shared_addr(ring), bar_addr = shared_addr(bars);
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) stage_init(bar_addr + 8 * st);
    stages_ready();
  }
  __syncwarp();

  const T* xr[NT];
  bool has_token[NT];
  token_rows<T, NT>(p, g, xr, has_token);
  // The warp's span of k as in decode_gemv_mma_kernel, in chunks of one stage.
  const int k = static_cast<int>(p.k);
  const Span span = warp_span(p.k, kChunk, WARPS, warp);
  const int kb0 = span.begin;
  const int chunks = kb0 < span.end ? (span.end - kb0 + kChunk - 1) / kChunk : 0;
  auto issue = [&](int i) {  // chunk i of the span into stage i % STAGES; the last chunk of k may be short
    const int kb = kb0 + i * kChunk;
    const uint32_t bytes = static_cast<uint32_t>(min(kChunk, k - kb)) * sizeof(T);
    const uint32_t bar = bar_addr + 8 * (i % STAGES);
    if (lane == 0) stage_expect(bar, bytes * kTileRows);
    __syncwarp();
    if (lane < kTileRows) {
      stage_copy(ring_addr + (i % STAGES) * Stage::kBytes + Stage::offset(lane), src + kb, bytes, bar);
    }
  };
#pragma unroll 1
  for (int i = 0; i < STAGES && i < chunks; ++i) issue(i);
  grid_dependency_wait();  // its first stages are in flight before h is ready

  // Token tile n's B fragments of chunk i (x or h), zero past k and for tokens past m (as in the register kernel).
  // Those of the next chunk are loaded before the next wait, so that their latency overlaps it.
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 b[NT][U];
  auto inputs = [&](int i) {
    const int kb = kb0 + i * kChunk;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int kk = kb + u * kStep + 8 * q;
        const uint4 v = kk < k ? load_input(xr[n] + kk) : zero;
        b[n][u] = has_token[n] ? v : zero;
      }
    }
  };
  if (chunks > 0) inputs(0);
  float acc[NMAT][1][NT][4] = {};
#pragma unroll 1
  for (int i = 0; i < chunks; ++i) {
    const int kb = kb0 + i * kChunk;
    stage_wait(bar_addr + 8 * (i % STAGES), (i / STAGES) & 1);
    const unsigned char* st = ring + (i % STAGES) * Stage::kBytes;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = kb + u * kStep + 8 * q < k;  // a short last chunk leaves stale bytes past k
      // Each weight vector read once, for every token tile.
      const int at = 64 * u + 16 * q;
      const uint4 lo = *reinterpret_cast<const uint4*>(st + Stage::offset(g) + at);
      const uint4 hi = *reinterpret_cast<const uint4*>(st + Stage::offset(g + 8) + at);
      const uint4 a0 = ok ? lo : zero, a1 = ok ? hi : zero;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        mma16816<T>(acc[0][0][n], a0.x, a1.x, a0.y, a1.y, b[n][u].x, b[n][u].y);
        mma16816<T>(acc[0][0][n], a0.z, a1.z, a0.w, a1.w, b[n][u].z, b[n][u].w);
      }
    }
    if (i + 1 < chunks) inputs(i + 1);
    if (i + STAGES < chunks) {
      stage_release();
      issue(i + STAGES);
    }
  }
  store_partials(part[warp], acc, g, q);
  __syncthreads();
  finish<T, WARPS, NMAT, ROWS, MT>(p, row0, part, threadIdx.x);
}

// Gate/up with the weights and x through shared memory (sm_90): a block of S::kTiles warps owns 16·kTiles hidden
// units; per stage one tensor copy brings Wg's and Wu's rows (a box of 16·kTiles rows × U·32 elements each) and one
// brings x's tokens over the same k (zeros past m and past k), all completing on the stage's mbarrier. Each warp
// multiplies its own 16 rows against the stage's x over the whole k, so it needs no partner and x never waits on L2.
struct GateUpMaps {
  CUtensorMap wg, wu, x;
};

__device__ __forceinline__ void stage_copy_box(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
#endif
}

template <int NT, class S>
struct GateUpLayout {
  static constexpr int kRowBytes = S::kUnroll * 64, kChunk = S::kUnroll * 32, MT = NT * 8;
  static constexpr int kBox = S::kTiles * kTileRows * kRowBytes;  // one matrix's rows
  static constexpr int kStage = 2 * kBox + MT * kRowBytes;
  static constexpr size_t kSmem = size_t(S::kStages) * (kStage + 8) + size_t(S::kTiles) * 2 * kTileRows * MT * 4;
};

template <typename T, int NT, class S>
__global__ void __launch_bounds__(S::kTiles * 32, S::kBlocksPerSM)
    decode_gate_up_tma_kernel(GemvArgs p, const __grid_constant__ GateUpMaps maps) {
  using L = GateUpLayout<NT, S>;
  constexpr int TILES = S::kTiles, U = S::kUnroll, STAGES = S::kStages, MT = L::MT, C = L::kRowBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  grid_dependents_may_launch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int row0 = blockIdx.x * TILES * kTileRows;
  const uint32_t base = shared_addr(smem), bar0 = base + STAGES * L::kStage;
  auto part = reinterpret_cast<float(*)[2][kTileRows][MT]>(smem + STAGES * (L::kStage + 8));
  const int k = static_cast<int>(p.k), chunks = (k + L::kChunk - 1) / L::kChunk;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) stage_init(bar0 + 8 * st);
    stages_ready();
  }
  __syncthreads();
  auto issue = [&](int i) {  // by thread 0
    const uint32_t st = base + (i % STAGES) * L::kStage, bar = bar0 + 8 * (i % STAGES);
    stage_expect(bar, L::kStage);  // a box counts its zero fill too
    stage_copy_box(st, &maps.wg, i * L::kChunk, row0, bar);
    stage_copy_box(st + L::kBox, &maps.wu, i * L::kChunk, row0, bar);
    stage_copy_box(st + 2 * L::kBox, &maps.x, i * L::kChunk, 0, bar);
  };
  if (threadIdx.x == 0) {
#pragma unroll 1
    for (int i = 0; i < STAGES && i < chunks; ++i) issue(i);
  }
  float acc[2][1][NT][4] = {};
#pragma unroll 1
  for (int i = 0; i < chunks; ++i) {
    stage_wait(bar0 + 8 * (i % STAGES), (i / STAGES) & 1);
    const unsigned char* st = smem + (i % STAGES) * L::kStage;
    const unsigned char* w = st + (warp * kTileRows + g) * C + 16 * q;
    const unsigned char* x = st + 2 * L::kBox + g * C + 16 * q;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint4 b[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) b[n] = *reinterpret_cast<const uint4*>(x + n * 8 * C + 64 * u);
#pragma unroll
      for (int mat = 0; mat < 2; ++mat) {
        const uint4 lo = *reinterpret_cast<const uint4*>(w + mat * L::kBox + 64 * u);
        const uint4 hi = *reinterpret_cast<const uint4*>(w + mat * L::kBox + 8 * C + 64 * u);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          mma16816<T>(acc[mat][0][n], lo.x, hi.x, lo.y, hi.y, b[n].x, b[n].y);
          mma16816<T>(acc[mat][0][n], lo.z, hi.z, lo.w, hi.w, b[n].z, b[n].w);
        }
      }
    }
    if (i + STAGES < chunks) {
      asm volatile("bar.sync 1, %0;" ::"n"(TILES * 32) : "memory");  // every warp has read the stage
      if (threadIdx.x == 0) {
        proxy_fence();
        issue(i + STAGES);
      }
    }
  }
  store_partials(part[warp], acc, g, q);
  __syncwarp();
  finish<T, 1, 2, kTileRows, MT, 32>(p, row0 + warp * kTileRows, part + warp, lane);  // the warp's own 16 rows
}

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
  finish<float, WARPS, NMAT, kTileRows, MT>(p, row0, part, threadIdx.x);
}

template <typename... Params>
void launch(void (*kernel)(Params...), unsigned blocks, unsigned threads, bool dependent, cudaStream_t stream,
            const GemvArgs& p, size_t smem = 0) {
  if (dependent) launch_dependent(kernel, dim3(blocks), dim3(threads), smem, stream, p);
  else kernel<<<blocks, threads, smem, stream>>>(p);
}

// The shared-memory kernel of shape S over p (16-bit types, sm_90); false (nothing launched) where the device does
// not give it the shared memory it needs.
template <typename T, int NMAT, int NT, class S>
bool launch_bulk(const GemvArgs& p, bool dependent, cudaStream_t stream) {
  constexpr auto kernel = decode_gemv_bulk_kernel<T, NMAT, NT, S>;
  constexpr size_t smem = bulk_smem_bytes<NMAT, NT, S>();
  if (!allow_shared_memory<kernel>(smem)) return false;
  launch(kernel, static_cast<unsigned>((p.rows + kTileRows - 1) / kTileRows), S::kWarps * 32, dependent, stream, p,
         smem);
  return true;
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled (found once; null where the driver has none).
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    cudaGetLastError();
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiled>(f) : nullptr;
  }();
  return fn;
}

// a [rows, cols] (row stride a.ld) as boxes of box_rows × box_cols elements, zeros past either end.
template <typename T>
bool tensor_map(CUtensorMap* map, Mat a, int64_t rows, int64_t cols, int box_rows, int box_cols) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(a.ld) * sizeof(T)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const auto type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, type, 2, const_cast<void*>(a.ptr), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Gate/up through tensor copies (16-bit types, sm_90); false (nothing launched) where the device or driver cannot.
template <typename T, int NT, class S>
bool launch_gate_up_tma(const GemvArgs& p, cudaStream_t stream) {
  using L = GateUpLayout<NT, S>;
  constexpr auto kernel = decode_gate_up_tma_kernel<T, NT, S>;
  if (!allow_shared_memory<kernel>(L::kSmem)) return false;
  GateUpMaps maps;
  const int rows_per_block = S::kTiles * kTileRows;
  if (!tensor_map<T>(&maps.wg, p.w0, p.rows, p.k, rows_per_block, L::kChunk) ||
      !tensor_map<T>(&maps.wu, p.w1, p.rows, p.k, rows_per_block, L::kChunk) ||
      !tensor_map<T>(&maps.x, p.in, p.m, p.k, L::MT, L::kChunk)) {
    return false;
  }
  const unsigned blocks = static_cast<unsigned>((p.rows + rows_per_block - 1) / rows_per_block);
  kernel<<<blocks, S::kTiles * 32, L::kSmem, stream>>>(p, maps);
  return true;
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
      constexpr int NT = decltype(nt)::value;
      using S = Shape<NMAT, NT>;
      if (bulk_copy_supported()) {
        if constexpr (NMAT == 2) {
          if (launch_gate_up_tma<T, NT, GateUpShape<NT>>(p, stream)) return;
        } else {
          if (launch_bulk<T, NMAT, NT, BulkShape>(p, dependent, stream)) return;
        }
      }
      launch(decode_gemv_mma_kernel<T, NMAT, NT>, blocks(kTileRows * S::kRowTiles), S::kWarps * 32, dependent, stream,
             p);
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
  // The kernels index within a row (k) in 32 bits; one block per 16 output rows stays far inside the grid's limit.
  return std::max(dim, hidden) <= (int64_t(1) << 30);
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
