// Pointwise kernels of the CUDA backend: the GLU forward h = act(g)·u, its backward, and bias + activation.
//
// They stream [rows, cols] matrices once, so what decides their speed is how many bytes each SM has in flight: HBM
// answers a load after a microsecond or more under load, and a few tens of KiB per SM in flight only cover that
// latency at full bandwidth if nothing else slows them. Each thread therefore issues every load of its tile first
// (R = 4 rows × one 16-byte vector per input), and only then converts, computes and stores: 128 bytes (forward)
// or 192 bytes (backward) per thread in flight, about 100 KiB per SM at the occupancy their registers allow. A
// thread that loaded, computed and stored one row at a time kept 32 bytes in flight and reached a third of the
// bandwidth.
//
// Layout: a block of 32×8 threads owns a strip of 32·V columns (V elements of 16 bytes per thread) and a tile of
// 8·R rows; thread (x, y) handles column vector x on rows y, y + 8, ... of the tile. A warp's access is 512
// contiguous bytes of one row, and a thread stays on one column vector, so the backward sums its bias gradients in
// fp32 registers and adds them with one (vector) atomic per column per block. One tile per block gives thousands of
// short blocks: the last, partial wave is short. Outputs may alias inputs (h over g, dg over g, ...): every element
// is read and then written by the same thread, and a thread's stores come after all of its loads.
#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace mlpfuse {
namespace {

constexpr int kThreadsX = 32;
constexpr int kThreadsY = 8;
// Rows per thread, all loaded before any is used. The forward (≤ 64 registers: 4 blocks, 1024 threads, 128 KiB in
// flight per SM) and the bias pass take 4. The backward takes 4 as well, capped at 128 registers (2 blocks, 512
// threads, 96 KiB in flight per SM): 2 rows at 3 blocks per SM hold less in flight, and a tighter cap spills.
constexpr int kFwdRows = 4;
constexpr int kBwdRows = 4;
constexpr int kBwdMinBlocks = 2;
constexpr int64_t kMaxGridY = 65535;

struct Grid {
  dim3 blocks, threads;
};

// Callers return before this for an empty matrix: a grid dimension of 0 is a launch error.
Grid strip_grid(int64_t rows, int64_t cols, int v, int rows_per_thread) {
  const int64_t strips = (cols + kThreadsX * v - 1) / (kThreadsX * v);
  const int64_t tile_rows = int64_t(kThreadsY) * rows_per_thread;
  const int64_t tiles = std::min<int64_t>((rows + tile_rows - 1) / tile_rows, kMaxGridY);
  return {dim3(static_cast<unsigned>(strips), static_cast<unsigned>(tiles)), dim3(kThreadsX, kThreadsY)};
}

// Whether every matrix can be read in 16-byte vectors of V elements: aligned base, row stride and width multiples
// of V. Otherwise the same kernels run with V = 1 (correct for any layout, slower).
bool vectorizable(int64_t cols, int v, std::initializer_list<Mat> mats) {
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

template <typename T, int V, int ACT>
__global__ void __launch_bounds__(kThreadsX * kThreadsY) glu_forward_kernel(int64_t rows, int64_t cols, Mat g, Mat u,
                                                                             Mat h) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  if (c >= cols) return;
  FOR_EACH_TILE(r0, rows, kFwdRows) {
    Raw<T, V> gr[kFwdRows], ur[kFwdRows];
#pragma unroll
    for (int i = 0; i < kFwdRows; ++i) {
      const int64_t r = tile_row(r0, i);
      if (r < rows) {
        gr[i] = load_raw<T, V>(at<T>(g, r, c));
        ur[i] = load_raw<T, V>(at<T>(u, r, c));
      }
    }
#pragma unroll
    for (int i = 0; i < kFwdRows; ++i) {
      const int64_t r = tile_row(r0, i);
      if (r >= rows) break;
      Raw<T, V> ho = {};
#pragma unroll
      for (int j = 0; j < V; ++j) set(ho, j, act_fwd<ACT>(get(gr[i], j)) * get(ur[i], j));  // rounded once, here
      store_raw<T, V>(at_mut<T>(h, r, c), ho);
    }
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

template <typename T, int V, int ACT>
__global__ void __launch_bounds__(kThreadsX * kThreadsY, kBwdMinBlocks)
    glu_backward_kernel(int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h, float* dbg,
                        float* dbu, bool vec4) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  const bool active = c < cols;  // no early return: the bias sums below meet at a barrier
  const bool write_h = h.ptr != nullptr;
  const bool sums = dbg != nullptr;
  float sum_g[V] = {}, sum_u[V] = {};
  if (active) {
    FOR_EACH_TILE(r0, rows, kBwdRows) {
      Raw<T, V> dr[kBwdRows], gr[kBwdRows], ur[kBwdRows];
#pragma unroll
      for (int i = 0; i < kBwdRows; ++i) {
        const int64_t r = tile_row(r0, i);
        if (r < rows) {
          dr[i] = load_raw<T, V>(at<T>(dh, r, c));
          gr[i] = load_raw<T, V>(at<T>(g, r, c));
          ur[i] = load_raw<T, V>(at<T>(u, r, c));
        }
      }
#pragma unroll
      for (int i = 0; i < kBwdRows; ++i) {
        const int64_t r = tile_row(r0, i);
        if (r >= rows) break;
        // Element by element from the raw vectors into raw outputs: 8 fp32 copies of each of 3 inputs and 3 outputs
        // at once would double the registers and halve the threads per SM.
        Raw<T, V> dgo = {}, duo = {}, ho = {};
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float d = get(dr[i], j), gj = get(gr[i], j), uj = get(ur[i], j);
          float a, da;
          act_fwd_grad<ACT>(gj, a, da);
          const float dgj = d * uj * da, duj = d * a;
          sum_g[j] += dgj;
          sum_u[j] += duj;
          set(dgo, j, dgj);
          set(duo, j, duj);
          set(ho, j, a * uj);  // h, only stored when asked for
        }
        store_raw<T, V>(at_mut<T>(dg, r, c), dgo);
        store_raw<T, V>(at_mut<T>(du, r, c), duo);
        if (write_h) store_raw<T, V>(at_mut<T>(h, r, c), ho);
      }
    }
  }
  if (!sums) return;  // uniform across the grid
  // Column sums of the block: fold the 8 row-threads of each column in shared memory, then one atomic per column.
  __shared__ float part[2][kThreadsY][kThreadsX * V];
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

template <typename T, int V, int ACT>
__global__ void __launch_bounds__(kThreadsX * kThreadsY) bias_act_kernel(int64_t rows, int64_t cols, Mat z,
                                                                          const T* bias, Mat y) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  if (c >= cols) return;
  float b[V] = {};
  if (bias != nullptr) {  // one bias vector per thread, reused on every row
    const Raw<T, V> br = load_raw<T, V>(bias + c);
#pragma unroll
    for (int j = 0; j < V; ++j) b[j] = get(br, j);
  }
  FOR_EACH_TILE(r0, rows, kFwdRows) {
    Raw<T, V> zr[kFwdRows];
#pragma unroll
    for (int i = 0; i < kFwdRows; ++i) {
      const int64_t r = tile_row(r0, i);
      if (r < rows) zr[i] = load_raw<T, V>(at<T>(z, r, c));
    }
#pragma unroll
    for (int i = 0; i < kFwdRows; ++i) {
      const int64_t r = tile_row(r0, i);
      if (r >= rows) break;
      Raw<T, V> yo = {};
#pragma unroll
      for (int j = 0; j < V; ++j) set(yo, j, act_fwd<ACT>(get(zr[i], j) + b[j]));
      store_raw<T, V>(at_mut<T>(y, r, c), yo);
    }
  }
}

}  // namespace

void glu_forward(DType dtype, int act, int64_t rows, int64_t cols, Mat g, Mat u, Mat h, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    with_act(act, [&](auto a) {
      constexpr int ACT = decltype(a)::value;
      if (vectorizable(cols, kVec<T>, {g, u, h})) {
        const Grid grid = strip_grid(rows, cols, kVec<T>, kFwdRows);
        glu_forward_kernel<T, kVec<T>, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, g, u, h);
      } else {
        const Grid grid = strip_grid(rows, cols, 1, kFwdRows);
        glu_forward_kernel<T, 1, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, g, u, h);
      }
    });
  });
}

void glu_backward(DType dtype, int act, int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h,
                  float* dbg, float* dbu, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  // 16-byte atomics need 16-byte aligned sums; a vectorized strip starts at a multiple of 4 columns.
  const bool vec4 = dbg != nullptr && aligned16(dbg) && aligned16(dbu);
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    with_act(act, [&](auto a) {
      constexpr int ACT = decltype(a)::value;
      if (vectorizable(cols, kVec<T>, {dh, g, u, dg, du, h})) {
        const Grid grid = strip_grid(rows, cols, kVec<T>, kBwdRows);
        glu_backward_kernel<T, kVec<T>, ACT>
            <<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu, vec4);
      } else {
        const Grid grid = strip_grid(rows, cols, 1, kBwdRows);
        glu_backward_kernel<T, 1, ACT>
            <<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu, false);
      }
    });
  });
}

void bias_act(DType dtype, int act, int64_t rows, int64_t cols, Mat z, const void* bias, Mat y, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const T* b = static_cast<const T*>(bias);
    with_act(act, [&](auto a) {
      constexpr int ACT = decltype(a)::value;
      if (vectorizable(cols, kVec<T>, {z, y, Mat{const_cast<void*>(bias), 0}})) {
        const Grid grid = strip_grid(rows, cols, kVec<T>, kFwdRows);
        bias_act_kernel<T, kVec<T>, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, z, b, y);
      } else {
        const Grid grid = strip_grid(rows, cols, 1, kFwdRows);
        bias_act_kernel<T, 1, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, z, b, y);
      }
    });
  });
}

}  // namespace mlpfuse
