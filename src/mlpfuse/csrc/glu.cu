// Pointwise kernels of the CUDA backend: the GLU forward h = act(g)·u, its backward, and bias + activation.
//
// They stream [rows, cols] matrices once, so what decides their speed is how many bytes each SM has in flight: HBM
// answers a load after a microsecond or more under load, and a few tens of KiB per SM in flight only cover that
// latency at full bandwidth if nothing else slows them. Each thread therefore issues every load of its tile first
// (rows × one vector per input), and only then converts, computes and stores: 128 bytes (forward, 4 rows of 16-byte
// vectors) or 96 bytes (backward, see kBwdVec) per thread in flight, about 100 KiB per SM at the occupancy their
// registers allow. A thread that loaded, computed and stored one row at a time kept 32 bytes in flight and reached
// a third of the bandwidth.
//
// Layout: a block of 32×8 threads owns a strip of 32·V columns (V elements of 16 bytes per thread) and a tile of
// 8·R rows; thread (x, y) handles column vector x on rows y, y + 8, ... of the tile. A warp's access is 512
// contiguous bytes of one row, and a thread stays on one column vector, so the backward sums its bias gradients in
// fp32 registers and adds them with one (vector) atomic per column per block. One tile per block gives thousands of
// short blocks: the last, partial wave is short. Outputs may alias inputs (h over g, dg over g, ...): every element
// is read and then written by the same thread, and a thread's stores come after all of its loads.
#include <algorithm>
#include <type_traits>

#include "glu.cuh"

namespace mlpfuse {
namespace {

// Rows per thread, all loaded before any is used. The forward (≤ 64 registers: 4 blocks, 1024 threads, 128 KiB in
// flight per SM) and the bias pass take 4.
constexpr int kFwdRows = 4;
// The backward keeps 96 bytes of its three inputs in flight per thread at 4 blocks per SM (≤ 64 registers), with one
// store instruction per vector: vectors of 4 elements (16 bytes of fp32, 8 of a 16-bit type; a warp still reads 256
// contiguous bytes of a row), 2 rows of them for fp32 and 4 for 16-bit types, whose 16-byte vectors' fp32 column
// sums would spill at that cap. 4 blocks at different points of their short lives stay closer to the peak in
// flight than 2 blocks of 4 rows of 16-byte vectors (128 registers) did: 68.7 µs against 75.7, 90.8 % of the copy
// bandwidth against 82.4 %, at 8192×3072 bf16 with bias sums on an H200; persistent blocks (the next tile loaded
// before the math, or a bulk-copy ring in shared memory) and cache hints measured no faster
// (benchmarks/results/nvidia-h200/cuda-backend/variants).
constexpr int kBwdVec = 4;
template <typename T>
constexpr int kBwdRows = sizeof(T) == 4 ? 2 : 4;
constexpr int kBwdMinBlocks = 4;

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
      constexpr int R = kBwdRows<T>;
      if (vectorizable(cols, kBwdVec, {dh, g, u, dg, du, h})) {
        const Grid grid = strip_grid(rows, cols, kBwdVec, R);
        glu_backward_kernel<T, kBwdVec, ACT, R, kBwdMinBlocks, kIoVector>
            <<<grid.blocks, grid.threads, 0, stream>>>(rows, cols, dh, g, u, dg, du, h, dbg, dbu, vec4);
      } else {
        const Grid grid = strip_grid(rows, cols, 1, R);
        glu_backward_kernel<T, 1, ACT, R, kBwdMinBlocks, kIoVector>
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
