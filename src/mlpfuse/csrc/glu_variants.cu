// Alternative GLU backward kernels, run only through the private entry _glu_backward_variant, so that one build can
// time them against the kernel in use (variant 0, glu.cu) and the fastest can replace it. Each has the backward's
// contract (glu_backward in kernels.h: outputs may alias inputs, fp32 column sums added with atomics), applies to the
// 16-byte-vector layouts and runs variant 0's kernel for the others. Variant 3 measured fastest (90.8 % of copy
// bandwidth against 82.4 %) and became the kernel in use; variant 3 is now the kernel it replaced, which the notes
// below (written before the swap) call "variant 0".
//
// Variant 0 (4 rows per thread, 128 registers, 2 blocks per SM) reaches 83–85 % of copy bandwidth at 8192×3072 bf16.
// Its SM holds at most 96 KiB in flight, and only while both of its blocks are between their first load and their
// last use: a block issues its loads, waits, computes, stores and retires, and its SM has nothing of that block in
// flight from its first use of data until a new block has issued its loads. And its stores are not what the source
// says: nvcc splits each 16-byte store into four 4-byte ones (glu.cuh, kIoPlain). What each variant tries:
//   1. variant 0 with one 16-byte store instruction per vector (kIoVector): a quarter of the store instructions
//      and of the L2 write requests for the two (three with h) of five matrices that are written.
//   2. variant 1 with cache hints (kIoHints): 256-byte L2 fetches for the inputs, evict-first stores.
//   3. 96 bytes in flight per thread at 4 blocks per SM (≤ 64 registers), vector stores: the same 96 KiB per SM at
//      the peak, but 4 blocks at different points of their short lives keep it closer to the peak, and the last wave
//      is shorter. 2 rows of 16-byte vectors fit 64 registers for fp32 only: for 16-bit types their 16 fp32 column
//      sums, 24 input and 12 output words spill (ptxas: 90–190 bytes), so those take 4 rows of 8-byte vectors (8
//      sums; a warp still reads 256 contiguous bytes of a row).
//   4. persistent blocks that never drain, vector stores: as many blocks as fit at once, each looping over its row
//      tiles and issuing the next tile's loads (registers) before it computes and stores the current one.
//   5. persistent blocks fed by the copy engine (sm_90), vector stores: a 4-stage ring in shared memory filled with
//      bulk copies (cp.async.bulk) that complete on an mbarrier; no registers hold bytes in flight (up to 192 KiB
//      per SM).
//
// An earlier ring (cp.async of 16 bytes per thread, 3 stages, 4 blocks per SM) reached only 54 %. What we think made
// it slow, and what 4 and 5 do instead: (a) its blocks each took one contiguous range of (strip, 8-row) units, so
// the 528 resident blocks streamed from 528 places spread over the whole matrices at once, each 512 bytes wide —
// DRAM pages opened for one 512-byte access and few of the accesses in flight were neighbours. Here block (s, p)
// takes row tiles p, p + P, p + 2P, ... of strip s: at any moment the resident blocks cover one band of whole rows,
// as variant 0's grid does, and the band moves down the matrices. (b) each 16-byte cp.async was an instruction per
// thread with a commit and a wait per 48 bytes; a bulk copy moves a 512-byte row segment per instruction issued by
// one lane. (c) its bias sums were flushed when a block's strip changed; here a block keeps one strip, so one flush.
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "glu.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MLPFUSE_SM90_DEVICE 1
#endif

namespace mlpfuse {

const char* const kGluBackwardVariants[] = {
    "in use: 96 B/thread, 4 blocks/SM, vector stores",
    "0 + 16-byte store instructions",
    "1 + L2::256B loads, .cs stores",
    "replaced: 4 rows/thread, 2 blocks/SM, plain stores",
    "persistent, next tile loaded before math",
    "persistent, 4-stage bulk-copy ring (sm_90)",
};
const int kGluBackwardVariantCount = int(sizeof(kGluBackwardVariants) / sizeof(kGluBackwardVariants[0]));

namespace {

// --- 4: persistent, software-pipelined in registers -------------------------------------------------------------

// Rows per thread of a tile. Two tiles live in registers (the one being finished and the next one in flight): 2 rows
// fit the 128-register cap of 2 blocks per SM without spilling; per SM 512 threads keep 96–192 bytes each in flight
// at all times instead of 192 bytes at the peak of a block's life.
constexpr int kPipeRows = 2;

template <typename T, int ACT>
__global__ void __launch_bounds__(kThreadsX * kThreadsY, 2)
    glu_backward_pipelined_kernel(int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h,
                                  float* dbg, float* dbu, bool vec4) {
  constexpr int V = kVec<T>, R = kPipeRows;
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  const bool active = c < cols;  // no early return: the bias sums meet at a barrier
  const bool write_h = h.ptr != nullptr;
  float sum_g[V] = {}, sum_u[V] = {};
  if (active) {
    // Row tiles blockIdx.y, + gridDim.y, ...; a and b take turns as the tile in flight and the tile being finished
    // (the loop is unrolled by two so that each stays in its own registers). A tile's loads are issued before the
    // previous tile's stores, which they may alias only in rows this thread has not stored yet: none.
    const int64_t tile = int64_t(kThreadsY) * R, step = int64_t(gridDim.y) * tile;
    int64_t r0 = int64_t(blockIdx.y) * tile;
    BwdTile<T, V, R> a, b;
    if (r0 < rows) load_tile<T, V, R, kIoVector>(a, r0, rows, c, dh, g, u);
    while (r0 < rows) {
      const int64_t r1 = r0 + step;
      if (r1 < rows) load_tile<T, V, R, kIoVector>(b, r1, rows, c, dh, g, u);
      finish_tile<T, V, ACT, R, kIoVector>(a, r0, rows, c, dg, du, h, write_h, sum_g, sum_u);
      if (r1 >= rows) break;
      r0 = r1 + step;
      if (r0 < rows) load_tile<T, V, R, kIoVector>(a, r0, rows, c, dh, g, u);
      finish_tile<T, V, ACT, R, kIoVector>(b, r1, rows, c, dg, du, h, write_h, sum_g, sum_u);
    }
  }
  if (dbg == nullptr) return;  // uniform across the grid
  __shared__ SumPart<V> part;
  flush_column_sums<V>(part, sum_g, sum_u, c, active, dbg, dbu, vec4);  // one flush per block: it keeps its strip
}

// --- 5: persistent, bulk copies into a shared-memory ring (sm_90) -----------------------------------------------

// A stage is 16 rows × one 512-byte strip row of each input (24 KiB; 2 rows per thread); 4 stages make 96 KiB, so
// 2 blocks fit per SM (192 KiB of the 228) with up to 4 stages each in flight.
constexpr int kBulkRows = 16;
constexpr int kBulkStages = 4;
constexpr size_t kBulkStageVectors = size_t(3) * kBulkRows * kThreadsX;  // 16-byte vectors per stage
constexpr size_t kBulkSmem = kBulkStages * kBulkStageVectors * 16;
static_assert(sizeof(SumPart<8>) <= kBulkSmem, "the column-sum fold reuses the ring");

#ifdef MLPFUSE_SM90_DEVICE
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <typename T, int V>
__device__ __forceinline__ Raw<T, V> raw_of(const uint4& q) {
  static_assert(sizeof(T) * V == 16, "16-byte vectors");
  Raw<T, V> r;
  r.w[0] = q.x, r.w[1] = q.y, r.w[2] = q.z, r.w[3] = q.w;
  return r;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// One arrival that also announces how many bytes the copies of this phase will deliver.
__device__ __forceinline__ void mbar_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Returns once the phase of the given parity has completed: its arrival made and its bytes landed (and visible).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into this block's shared memory by
// the copy engine; their arrival is counted on bar.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(bar)
               : "memory");
}
#endif

template <typename T, int ACT>
__global__ void __launch_bounds__(kThreadsX * kThreadsY, 2)
    glu_backward_bulk_kernel(int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h, float* dbg,
                             float* dbu, bool vec4) {
#ifdef MLPFUSE_SM90_DEVICE
  constexpr int V = kVec<T>, R = kBulkRows / kThreadsY, S = kBulkStages;
  constexpr int kPlane = kBulkRows * kThreadsX;  // vectors of one input in a stage
  extern __shared__ __align__(16) uint4 ring[];  // [stage][input: dh, g, u][row][32 vectors]
  __shared__ __align__(8) uint64_t full[S];      // stage s holds tile i (i % S == s) once phase i / S completes
  const int64_t c0 = int64_t(blockIdx.x) * kThreadsX * V, c = c0 + threadIdx.x * V;
  const bool active = c < cols;
  const bool write_h = h.ptr != nullptr;
  // The strip's width in bytes: a multiple of 16 (cols is a multiple of V), 512 but in the last strip.
  const uint32_t row_bytes = static_cast<uint32_t>(std::min<int64_t>(kThreadsX * V, cols - c0) * sizeof(T));
  const int64_t row_tiles = (rows + kBulkRows - 1) / kBulkRows;
  const int64_t n = blockIdx.y < row_tiles ? (row_tiles - 1 - blockIdx.y) / gridDim.y + 1 : 0;  // this block's
  const auto first_row = [&](int64_t i) { return (int64_t(blockIdx.y) + i * gridDim.y) * kBulkRows; };

  if (threadIdx.x == 0 && threadIdx.y == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(smem_addr(&full[s]), kThreadsY);  // one arrival per warp
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the copy engine sees them initialised
  }
  __syncthreads();

  // Tile i into stage i % S, called by every warp for its own rows y and y + 8 (those that exist): lane 0 arrives
  // with the warp's byte count, then one lane per row and input issues its copy. Each warp issuing 6 copies keeps
  // the issue (one copy at a time per warp: the copy takes uniform operands) off any one warp's critical path.
  const auto issue = [&](int64_t i) {
    const int64_t r0 = first_row(i);
    const int s = static_cast<int>(i % S);
    const uint32_t bar = smem_addr(&full[s]);
    int mine = 0;
#pragma unroll
    for (int k = 0; k < R; ++k) mine += r0 + threadIdx.y + k * kThreadsY < rows;
    if (threadIdx.x == 0) mbar_arrive_expect_bytes(bar, 3u * mine * row_bytes);
    __syncwarp();
    if (threadIdx.x < 3 * R) {
      const int input = threadIdx.x / R, r = threadIdx.y + (threadIdx.x % R) * kThreadsY;
      if (r0 + r < rows) {
        const Mat m = input == 0 ? dh : (input == 1 ? g : u);
        bulk_load(smem_addr(ring + s * kBulkStageVectors + input * kPlane + r * kThreadsX), at<T>(m, r0 + r, c0),
                  row_bytes, bar);
      }
    }
  };
  for (int64_t i = 0; i < std::min<int64_t>(S, n); ++i) issue(i);

  float sum_g[V] = {}, sum_u[V] = {};
  for (int64_t i = 0; i < n; ++i) {
    const int s = static_cast<int>(i % S);
    mbar_wait(smem_addr(&full[s]), static_cast<uint32_t>(i / S) & 1u);
    BwdTile<T, V, R> t;
    const uint4* stage = ring + s * kBulkStageVectors;
#pragma unroll
    for (int k = 0; k < R; ++k) {  // the thread's rows y and y + 8 of the tile, as tile_row numbers them
      const int at_row = (threadIdx.y + k * kThreadsY) * kThreadsX + threadIdx.x;
      t.d[k] = raw_of<T, V>(stage[at_row]);
      t.g[k] = raw_of<T, V>(stage[kPlane + at_row]);
      t.u[k] = raw_of<T, V>(stage[2 * kPlane + at_row]);
    }
    __syncthreads();  // every thread has read stage s: it may be refilled
    if (i + S < n) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // those reads before the copy engine's writes
      issue(i + S);
    }
    if (active) finish_tile<T, V, ACT, R, kIoVector>(t, first_row(i), rows, c, dg, du, h, write_h, sum_g, sum_u);
  }
  if (dbg == nullptr) return;
  // Every stage was read before the last barrier and no copy is outstanding: the ring holds the fold.
  flush_column_sums<V>(*reinterpret_cast<SumPart<V>*>(ring), sum_g, sum_u, c, active, dbg, dbu, vec4);
#endif
}

// --- launch ----------------------------------------------------------------------------------------------------

// Blocks of a kernel resident at once on the current device (SMs × blocks per SM), found once per kernel and device;
// kernels with more than 48 KiB of dynamic shared memory are allowed it here first.
int64_t resident_blocks(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*>, int64_t> known;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, kernel);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int sms = 0, per_sm = 0;
  bool ok = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess;
  if (ok && smem > 48 * 1024) {
    ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) ==
         cudaSuccess;
  }
  ok = ok && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) == cudaSuccess;
  if (!ok) cudaGetLastError();
  const int64_t blocks = ok ? int64_t(sms) * per_sm : 0;
  known[key] = blocks;
  return blocks;
}

// The persistent kernels' grid: every strip gets the same number P of row lanes (grid.y), P as large as the
// resident blocks allow, then lowered to the fewest lanes that give every lane the same number of tiles give or take
// one.
dim3 persistent_grid(int64_t strips, int64_t row_tiles, int64_t resident) {
  int64_t lanes = std::max<int64_t>(1, std::min(resident / strips, row_tiles));
  const int64_t per_lane = (row_tiles + lanes - 1) / lanes;
  lanes = std::min<int64_t>((row_tiles + per_lane - 1) / per_lane, kMaxGridY);
  return dim3(static_cast<unsigned>(strips), static_cast<unsigned>(lanes));
}

bool device_is_sm90() {
  int dev = 0, major = 0;
  const bool ok = cudaGetDevice(&dev) == cudaSuccess &&
                  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok && major >= 9;
}

}  // namespace

bool glu_backward_variant(int variant, DType dtype, int act, int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg,
                          Mat du, Mat h, float* dbg, float* dbu, cudaStream_t stream) {
  if (variant < 0 || variant >= kGluBackwardVariantCount) return false;
  if (variant == 5 && !device_is_sm90()) return false;
  const int v = dtype == DType::f32 ? 4 : 8;
  if (variant == 0 || rows == 0 || cols == 0 || !vectorizable(cols, v, {dh, g, u, dg, du, h})) {
    glu_backward(dtype, act, rows, cols, dh, g, u, dg, du, h, dbg, dbu, stream);
    return true;
  }
  const bool vec4 = dbg != nullptr && aligned16(dbg) && aligned16(dbu);
  const dim3 threads(kThreadsX, kThreadsY);
  const int64_t strips = (cols + kThreadsX * v - 1) / (kThreadsX * v);
  bool launched = true;
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int V = kVec<T>;
    with_act(act, [&](auto a) {
      constexpr int ACT = decltype(a)::value;
      const auto tiled = [&](auto kernel, int vec, int rows_per_thread) {
        const Grid grid = strip_grid(rows, cols, vec, rows_per_thread);
        kernel<<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu, vec4);
      };
      const auto persistent = [&](auto kernel, int tile_rows, size_t smem) {
        const int64_t resident = resident_blocks(reinterpret_cast<const void*>(kernel), kThreadsX * kThreadsY, smem);
        if (resident <= 0) {
          launched = false;
          return;
        }
        const dim3 grid = persistent_grid(strips, (rows + tile_rows - 1) / tile_rows, resident);
        kernel<<<grid, threads, smem, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu, vec4);
      };
      switch (variant) {
        case 1: tiled(glu_backward_kernel<T, V, ACT, 4, 2, kIoVector>, V, 4); break;
        case 2: tiled(glu_backward_kernel<T, V, ACT, 4, 2, kIoHints>, V, 4); break;
        case 3: tiled(glu_backward_kernel<T, V, ACT, 4, 2, kIoPlain>, V, 4); break;
        case 4: persistent(glu_backward_pipelined_kernel<T, ACT>, kThreadsY * kPipeRows, 0); break;
        default: persistent(glu_backward_bulk_kernel<T, ACT>, kBulkRows, kBulkSmem); break;
      }
    });
  });
  return launched;
}

}  // namespace mlpfuse
