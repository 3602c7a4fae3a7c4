// Pointwise kernels of the CUDA backend: the GLU forward h = act(g)·u, its backward, and bias + activation.
//
// All three walk a [rows, cols] matrix the same way. A block of 32×8 threads owns a strip of 32·V columns (V elements
// of 16 bytes per thread) and kRowsPerBlock rows; thread (x, y) handles column vector x on rows y, y + 8, ... of the
// strip. Rows are contiguous in memory, so a warp's loads are 512 contiguous bytes: full 128-byte lines, one 16-byte
// access per thread. Keeping a thread on one column vector for many rows is what lets the backward sum its bias
// gradients in fp32 registers and issue one atomic per column per block.
#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace mlpfuse {
namespace {

constexpr int kThreadsX = 32;
constexpr int kThreadsY = 8;
constexpr int kRowsPerBlock = 64;
constexpr int64_t kMaxGridY = 65535;

struct Grid {
  dim3 blocks, threads;
};

// Callers return before this for an empty matrix: a grid dimension of 0 is a launch error.
Grid strip_grid(int64_t rows, int64_t cols, int v) {
  const int64_t strips = (cols + kThreadsX * v - 1) / (kThreadsX * v);
  const int64_t row_blocks = std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, kMaxGridY);
  return {dim3(static_cast<unsigned>(strips), static_cast<unsigned>(row_blocks)), dim3(kThreadsX, kThreadsY)};
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

// The rows of block row-group `by` (grid-stride over blockIdx.y when rows exceed 65535 · kRowsPerBlock).
#define FOR_EACH_ROW(r, rows)                                                                          \
  for (int64_t r0 = int64_t(blockIdx.y) * kRowsPerBlock; r0 < (rows); r0 += int64_t(gridDim.y) * kRowsPerBlock) \
    for (int64_t r = r0 + threadIdx.y, r_end = min(r0 + kRowsPerBlock, (rows)); r < r_end; r += kThreadsY)

template <typename T, int V, int ACT>
__global__ void glu_forward_kernel(int64_t rows, int64_t cols, Mat g, Mat u, Mat h) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  if (c >= cols) return;
  const T* gp = static_cast<const T*>(g.ptr);
  const T* up = static_cast<const T*>(u.ptr);
  T* hp = static_cast<T*>(h.ptr);
  FOR_EACH_ROW(r, rows) {
    float gv[V], uv[V];
    load_vec<T, V>(gp + r * g.ld + c, gv);
    load_vec<T, V>(up + r * u.ld + c, uv);
#pragma unroll
    for (int i = 0; i < V; ++i) gv[i] = act_fwd<ACT>(gv[i]) * uv[i];  // rounded once, on the store
    store_vec<T, V>(hp + r * h.ld + c, gv);
  }
}

template <typename T, int V, int ACT>
__global__ void glu_backward_kernel(int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h,
                                    float* dbg, float* dbu) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  const bool active = c < cols;  // no early return: the bias sums below meet at a barrier
  const bool write_h = h.ptr != nullptr;
  const bool sums = dbg != nullptr;
  float sum_g[V] = {}, sum_u[V] = {};
  if (active) {
    FOR_EACH_ROW(r, rows) {
      float d[V], gv[V], uv[V], dgv[V], duv[V];
      load_vec<T, V>(static_cast<const T*>(dh.ptr) + r * dh.ld + c, d);
      load_vec<T, V>(static_cast<const T*>(g.ptr) + r * g.ld + c, gv);
      load_vec<T, V>(static_cast<const T*>(u.ptr) + r * u.ld + c, uv);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float a = act_fwd<ACT>(gv[i]);
        dgv[i] = d[i] * uv[i] * act_grad<ACT>(gv[i]);
        duv[i] = d[i] * a;
        sum_g[i] += dgv[i];
        sum_u[i] += duv[i];
        gv[i] = a * uv[i];  // h, only stored when asked for
      }
      // The stores come after every load of this row: dg/du/h may be g/u/dh themselves.
      store_vec<T, V>(static_cast<T*>(dg.ptr) + r * dg.ld + c, dgv);
      store_vec<T, V>(static_cast<T*>(du.ptr) + r * du.ld + c, duv);
      if (write_h) store_vec<T, V>(static_cast<T*>(h.ptr) + r * h.ld + c, gv);
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
  if (threadIdx.y != 0 || !active) return;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    float sg = 0.0f, su = 0.0f;
    for (int y = 0; y < kThreadsY; ++y) {
      sg += part[0][y][threadIdx.x * V + i];
      su += part[1][y][threadIdx.x * V + i];
    }
    atomicAdd(dbg + c + i, sg);
    atomicAdd(dbu + c + i, su);
  }
}

template <typename T, int V, int ACT>
__global__ void bias_act_kernel(int64_t rows, int64_t cols, Mat z, const T* bias, Mat y) {
  const int64_t c = (int64_t(blockIdx.x) * kThreadsX + threadIdx.x) * V;
  if (c >= cols) return;
  float b[V] = {};
  if (bias != nullptr) load_vec<T, V>(bias + c, b);  // one bias vector per thread, reused on every row
  FOR_EACH_ROW(r, rows) {
    float v[V];
    load_vec<T, V>(static_cast<const T*>(z.ptr) + r * z.ld + c, v);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = act_fwd<ACT>(v[i] + b[i]);
    store_vec<T, V>(static_cast<T*>(y.ptr) + r * y.ld + c, v);
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
        const Grid grid = strip_grid(rows, cols, kVec<T>);
        glu_forward_kernel<T, kVec<T>, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, g, u, h);
      } else {
        const Grid grid = strip_grid(rows, cols, 1);
        glu_forward_kernel<T, 1, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, g, u, h);
      }
    });
  });
}

void glu_backward(DType dtype, int act, int64_t rows, int64_t cols, Mat dh, Mat g, Mat u, Mat dg, Mat du, Mat h,
                  float* dbg, float* dbu, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    with_act(act, [&](auto a) {
      constexpr int ACT = decltype(a)::value;
      if (vectorizable(cols, kVec<T>, {dh, g, u, dg, du, h})) {
        const Grid grid = strip_grid(rows, cols, kVec<T>);
        glu_backward_kernel<T, kVec<T>, ACT>
            <<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu);
      } else {
        const Grid grid = strip_grid(rows, cols, 1);
        glu_backward_kernel<T, 1, ACT>
            <<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu);
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
        const Grid grid = strip_grid(rows, cols, kVec<T>);
        bias_act_kernel<T, kVec<T>, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, z, b, y);
      } else {
        const Grid grid = strip_grid(rows, cols, 1);
        bias_act_kernel<T, 1, ACT><<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, z, b, y);
      }
    });
  });
}

}  // namespace mlpfuse
