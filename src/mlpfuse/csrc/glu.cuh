// The pointwise kernels' tiling and the GLU backward's building blocks, used by glu.cu (its opening comment explains
// the layout): blocks of 32×8 threads, a thread on one 16-byte column vector and R rows of a tile.
#pragma once

#include <algorithm>
#include <initializer_list>

#include "common.cuh"

namespace mlpfuse {
namespace {

constexpr int kThreadsX = 32;
constexpr int kThreadsY = 8;
constexpr int64_t kMaxGridY = 65535;

struct Grid {
  dim3 blocks, threads;
};

// Callers return before this for an empty matrix: a grid dimension of 0 is a launch error.
inline Grid strip_grid(int64_t rows, int64_t cols, int v, int rows_per_thread) {
  const int64_t strips = (cols + kThreadsX * v - 1) / (kThreadsX * v);
  const int64_t tile_rows = int64_t(kThreadsY) * rows_per_thread;
  const int64_t tiles = std::min<int64_t>((rows + tile_rows - 1) / tile_rows, kMaxGridY);
  return {dim3(static_cast<unsigned>(strips), static_cast<unsigned>(tiles)), dim3(kThreadsX, kThreadsY)};
}

// Whether every matrix can be read in 16-byte vectors of V elements: aligned base, row stride and width multiples
// of V. Otherwise the same kernels run with V = 1 (correct for any layout, slower).
inline bool vectorizable(int64_t cols, int v, std::initializer_list<Mat> mats) {
  if (cols % v != 0) return false;
  for (const Mat& m : mats) {
    if (m.ptr != nullptr && (!aligned16(m.ptr) || m.ld % v != 0)) return false;
  }
  return true;
}

// The first row of each tile of R rows per thread: one tile per block unless rows exceed 65535 tiles (then
// grid-stride).
#define FOR_EACH_TILE(r0, rows, R) \
  for (int64_t r0 = int64_t(blockIdx.y) * kThreadsY * (R); r0 < (rows); r0 += int64_t(gridDim.y) * kThreadsY * (R))

// Row i of this thread in the tile starting at r0.
__device__ __forceinline__ int64_t tile_row(int64_t r0, int i) { return r0 + threadIdx.y + int64_t(i) * kThreadsY; }

template <typename T>
__device__ __forceinline__ const T* at(Mat m, int64_t r, int64_t c) {
  return static_cast<const T*>(m.ptr) + r * m.ld + c;
}

template <typename T>
__device__ __forceinline__ T* at_mut(Mat m, int64_t r, int64_t c) {
  return static_cast<T*>(m.ptr) + r * m.ld + c;
}

// How the backward's kernels move their vectors:
//   kIoPlain: as C++ loads and stores. nvcc 13 emits each thread's 16-byte load as one instruction but splits its
//     16-byte store into four 4-byte stores (st.global.u32 at +0, +4, +8, +12: four times the store instructions
//     and L2 write requests of the outputs).
//   kIoVector: one store instruction per vector (st.global.v4.u32, v2 for 8 bytes), written in PTX. Aliased outputs
//     (dg over g, h over dh) need no memory clobber: a thread's store to an element depends on its own load of that
//     element, and no other element it loads is one it stores.
// (Cache hints — L1::no_allocate, 256-byte L2 fetches, evict-first stores — measured no faster on an H200.)
enum Io : int { kIoPlain = 0, kIoVector = 1 };

template <typename T, int V, int IO>
__device__ __forceinline__ void store_out(T* p, const Raw<T, V>& r) {
  if constexpr (IO == kIoVector && sizeof(T) * V == 16) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.w[0]), "r"(r.w[1]), "r"(r.w[2]),
                 "r"(r.w[3]));
  } else if constexpr (IO == kIoVector && sizeof(T) * V == 8) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(r.w[0]), "r"(r.w[1]));
  } else {
    store_raw<T, V>(p, r);
  }
}

// One thread's inputs for R rows of a tile, as raw words (see Raw).
template <typename T, int V, int R>
struct BwdTile {
  Raw<T, V> d[R], g[R], u[R];
};

// Issues every load of the thread's R rows of the tile at r0 (rows past the end are skipped).
template <typename T, int V, int R, int IO>
__device__ __forceinline__ void load_tile(BwdTile<T, V, R>& t, int64_t r0, int64_t rows, int64_t c, Mat dh, Mat g,
                                          Mat u) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = tile_row(r0, i);
    if (r < rows) {
      t.d[i] = load_raw<T, V>(at<T>(dh, r, c));
      t.g[i] = load_raw<T, V>(at<T>(g, r, c));
      t.u[i] = load_raw<T, V>(at<T>(u, r, c));
    }
  }
}

// dg = dh·u·act'(g), du = dh·act(g) (and h = act(g)·u when write_h) for the loaded rows, added to the thread's
// column sums in fp32 before rounding.
template <typename T, int V, int ACT, int R, int IO>
__device__ __forceinline__ void finish_tile(const BwdTile<T, V, R>& t, int64_t r0, int64_t rows, int64_t c, Mat dg,
                                            Mat du, Mat h, bool write_h, float (&sum_g)[V], float (&sum_u)[V]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = tile_row(r0, i);
    if (r >= rows) break;
    // Element by element from the raw vectors into raw outputs: 8 fp32 copies of each of 3 inputs and 3 outputs
    // at once would double the registers and halve the threads per SM.
    Raw<T, V> dgo = {}, duo = {}, ho = {};
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = get(t.d[i], j), gj = get(t.g[i], j), uj = get(t.u[i], j);
      float a, da;
      act_fwd_grad<ACT>(gj, a, da);
      const float dgj = d * uj * da, duj = d * a;
      sum_g[j] += dgj;
      sum_u[j] += duj;
      set(dgo, j, dgj);
      set(duo, j, duj);
      set(ho, j, a * uj);  // h, only stored when asked for
    }
    store_out<T, V, IO>(at_mut<T>(dg, r, c), dgo);
    store_out<T, V, IO>(at_mut<T>(du, r, c), duo);
    if (write_h) store_out<T, V, IO>(at_mut<T>(h, r, c), ho);
  }
}

// Adds a block's column sums (V consecutive columns from c) to out: one 16-byte atomic per 4 columns where the
// vector allows it, which quarters the atomics that all blocks aim at the same few hundred cache lines.
template <int V>
__device__ __forceinline__ void add_column_sums(float* out, int64_t c, const float (&s)[V], bool vec4) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // the 16-byte float atomic is sm_90's
  if constexpr (V % 4 == 0) {
    if (vec4) {
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        atomicAdd(reinterpret_cast<float4*>(out + c + i), make_float4(s[i], s[i + 1], s[i + 2], s[i + 3]));
      }
      return;
    }
  }
#endif
#pragma unroll
  for (int i = 0; i < V; ++i) atomicAdd(out + c + i, s[i]);
}

// The shared memory that folds a block's column sums: [dg or du][row-thread][column].
template <int V>
using SumPart = float[2][kThreadsY][kThreadsX * V];

// Column sums of the block: fold the 8 row-threads of each column in part (free for this use), then one atomic per
// column. Every thread of the block calls it (it has a barrier).
template <int V>
__device__ __forceinline__ void flush_column_sums(SumPart<V>& part, const float (&sum_g)[V], const float (&sum_u)[V],
                                                  int64_t c, bool active, float* dbg, float* dbu, bool vec4) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    part[0][threadIdx.y][threadIdx.x * V + i] = sum_g[i];
    part[1][threadIdx.y][threadIdx.x * V + i] = sum_u[i];
  }
  __syncthreads();
  if (threadIdx.y >= 2 || !active) return;
  // Row-thread 0 adds the dg sums and row-thread 1 the du sums: the two sets of atomics go out in parallel.
  const int which = threadIdx.y;
  float s[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    s[i] = 0.0f;
    for (int y = 0; y < kThreadsY; ++y) s[i] += part[which][y][threadIdx.x * V + i];
  }
  add_column_sums<V>(which == 0 ? dbg : dbu, c, s, vec4);
}

// The backward with R rows per thread, all loaded before any is used, the register cap of MIN_BLOCKS blocks per SM
// and vectors moved as IO says; one tile per block (grid-stride past 65535 tiles). glu.cu's constants say which.
template <typename T, int V, int ACT, int R, int MIN_BLOCKS, int IO>
__global__ void __launch_bounds__(kThreadsX * kThreadsY, MIN_BLOCKS)
    glu_backward_kernel(int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h, float* dbg,
                        float* dbu, bool vec4) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  const bool active = c < cols;  // no early return: the bias sums below meet at a barrier
  const bool write_h = h.ptr != nullptr;
  float sum_g[V] = {}, sum_u[V] = {};
  if (active) {
    FOR_EACH_TILE(r0, rows, R) {
      BwdTile<T, V, R> t;
      load_tile<T, V, R, IO>(t, r0, rows, c, dh, g, u);
      finish_tile<T, V, ACT, R, IO>(t, r0, rows, c, dg, du, h, write_h, sum_g, sum_u);
    }
  }
  if (dbg == nullptr) return;  // uniform across the grid
  __shared__ SumPart<V> part;
  flush_column_sums<V>(part, sum_g, sum_u, c, active, dbg, dbu, vec4);
}

}  // namespace
}  // namespace mlpfuse
