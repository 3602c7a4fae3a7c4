// Alternative shapes of the decode MLP's kernel 2 (y = h·Wdᵀ + bd), run only through the private entry
// _decode_variant, so that one build can time them against the shape in use (variant 0, decode.cu). Kernel 1 is the
// one in use in every variant; fp32 inputs (CUDA-core kernels) run variant 0.
//
// Kernel 2 streams Wd ([dim, hidden]) against h ([m, hidden], written by kernel 1, read from L2). A block owns ROWS
// output rows and reads h once for them, so the SMs take m/ROWS bytes of h through L2 for every byte of Wd: 0.5 at
// 8 tokens (16-row blocks) and at 16 tokens (32-row blocks), where variant 0 reaches 87–91 % and 80 % of copy
// bandwidth. With one block per SM over all of k, rows per block cannot grow: dim / 132 SMs is 31 rows. So:
//   1. a 2-CTA cluster shares 64 rows (8 warps × 4 row tiles) and splits k: each CTA streams its 64 rows over an
//      interleaved half of k, so the h bytes per Wd byte halve (0.25 at 16 tokens, 0.125 at 8) at the same grid
//      (dim / 32 CTAs, one per SM). The two halves meet through distributed shared memory in a fixed order
//      (decode.cuh finish_split): deterministic, no atomics, no extra launch. 8 warps of U = 4 vectors per row and
//      lane (≈ 210 registers, 128 KiB in flight per SM) rather than 16 of U = 2, whose 128-register cap leaves no
//      room for 8 row halves, 2 token tiles and 32 accumulators. sm_90 only.
//   2. at 1–8 tokens, variant 0's 16-token shape: 32-row blocks, 16 warps of U = 4 (88 registers, 128 KiB per SM,
//      one block per SM): h costs 0.25 of the Wd bytes instead of 0.5, with no cluster. 9–16 tokens as variant 0.
#include <type_traits>

#include "decode.cuh"

namespace mlpfuse {

const char* const kDecodeVariants[] = {
    "in use",
    "kernel 2: 2-CTA cluster splits k, 64 rows (sm_90)",
    "kernel 2 at 1-8 tokens: 32-row blocks",
};
const int kDecodeVariantCount = int(sizeof(kDecodeVariants) / sizeof(kDecodeVariants[0]));

namespace {

template <int NT>
struct SplitShape {  // variant 1
  static constexpr int kWarps = 8, kRowTiles = 4, kUnroll = 4, kBlocksPerSM = 1, kSplit = 2;
};

struct Rows32Shape {  // variant 2, one token tile
  static constexpr int kWarps = 16, kRowTiles = 2, kUnroll = 4, kBlocksPerSM = 1, kSplit = 1;
};

// kernel as a cluster launch of `cluster` CTAs, the programmatic dependent of the kernel before it where the device
// takes that (as decode.cu launches kernel 2); false if the runtime refuses the cluster.
template <typename... Params>
bool launch_cluster(void (*kernel)(Params...), unsigned blocks, unsigned threads, unsigned cluster,
                    cudaStream_t stream, const GemvArgs& p) {
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = dependent_launch_supported() ? 2 : 1;
  if (cudaLaunchKernelEx(&config, kernel, p) == cudaSuccess) return true;
  cudaGetLastError();
  if (config.numAttrs == 1) return false;
  config.numAttrs = 1;  // the cluster alone
  if (cudaLaunchKernelEx(&config, kernel, p) == cudaSuccess) return true;
  cudaGetLastError();
  return false;
}

bool device_is_sm90() {
  int dev = 0, major = 0;
  const bool ok = cudaGetDevice(&dev) == cudaSuccess &&
                  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok && major >= 9;
}

}  // namespace

bool decode_variant_runnable(int variant, DType dtype) {
  if (variant < 0 || variant >= kDecodeVariantCount) return false;
  return variant != 1 || dtype == DType::f32 || device_is_sm90();
}

bool decode_gated_mlp_variant(int variant, DType dtype, int act, int64_t m, int64_t dim, int64_t hidden, Mat x,
                              Mat wg, Mat wu, Mat wd, const void* bg, const void* bu, const void* bd, Mat h, Mat y,
                              cudaStream_t stream) {
  if (!decode_variant_runnable(variant, dtype)) return false;
  if (variant == 0 || dtype == DType::f32 || (variant == 2 && m > 8)) {
    decode_gated_mlp(dtype, act, m, dim, hidden, x, wg, wu, wd, bg, bu, bd, h, y, stream);
    return true;
  }
  const int tokens = static_cast<int>(m);
  const GemvArgs up{tokens, act, dim, hidden, wg, wu, x, bg, bu, h};
  const GemvArgs down{tokens, IDENTITY, hidden, dim, wd, Mat{nullptr, 0}, h, bd, nullptr, y};
  bool ok = true;
  with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, float>) {
      const auto go_up = [&](auto nt) {
        using S = Shape<2, decltype(nt)::value>;
        const auto blocks = static_cast<unsigned>((hidden + kTileRows - 1) / kTileRows);
        launch(decode_gemv_mma_kernel<T, 2, decltype(nt)::value>, blocks, S::kWarps * 32, false, stream, up);
      };
      if (m <= 8) go_up(std::integral_constant<int, 1>{});
      else go_up(std::integral_constant<int, 2>{});
      if (variant == 1) {
        const auto go = [&](auto nt) {
          constexpr int NT = decltype(nt)::value;
          using S = SplitShape<NT>;
          constexpr int64_t rows = int64_t(kTileRows) * S::kRowTiles;
          const auto blocks = static_cast<unsigned>((dim + rows - 1) / rows * S::kSplit);
          ok = launch_cluster(decode_gemv_mma_kernel<T, 1, NT, S>, blocks, S::kWarps * 32, S::kSplit, stream, down);
        };
        if (m <= 8) go(std::integral_constant<int, 1>{});
        else go(std::integral_constant<int, 2>{});
      } else {  // variant 2, m <= 8
        using S = Rows32Shape;
        const auto blocks = static_cast<unsigned>((dim + kTileRows * S::kRowTiles - 1) / (kTileRows * S::kRowTiles));
        launch(decode_gemv_mma_kernel<T, 1, 1, S>, blocks, S::kWarps * 32, true, stream, down);
      }
    }
  });
  return ok;
}

}  // namespace mlpfuse
