// Device helpers shared by mlpfuse's CUDA kernels: element conversions, 16-byte vectors held as raw words, the
// activations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace mlpfuse {

// Explicit conversions: torch builds extensions with the implicit half/bfloat16 conversions switched off.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// V elements moved as one load/store. With V * sizeof(T) == 16 that is one 128-bit instruction: the pointwise kernels
// are bound by memory bandwidth, and narrower accesses leave part of it unused. Loads are split from conversions so
// that a kernel can issue all of its loads before it needs the first value: the bytes in flight per thread, not the
// instruction count, decide how close a streaming kernel gets to bandwidth. While in flight the data stays in 32-bit
// words: an array of 16-bit element objects kept across other loads takes one register per element, twice the
// registers and so half the threads per SM.
template <typename T, int V>
struct Raw {
  static constexpr int kWords = (int(sizeof(T)) * V + 3) / 4;
  uint32_t w[kWords];
};

template <typename T, int V>
__device__ __forceinline__ Raw<T, V> load_raw(const T* p) {
  Raw<T, V> r;
  if constexpr (sizeof(T) * V == 16) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    r.w[0] = q.x, r.w[1] = q.y, r.w[2] = q.z, r.w[3] = q.w;
  } else if constexpr (sizeof(T) * V == 8) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    r.w[0] = q.x, r.w[1] = q.y;
  } else if constexpr (sizeof(T) * V == 4) {
    r.w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(sizeof(T) == 2 && V == 1, "16-, 8- or 4-byte vectors, or single elements");
    r.w[0] = *reinterpret_cast<const unsigned short*>(p);
  }
  return r;
}

template <typename T, int V>
__device__ __forceinline__ void store_raw(T* p, const Raw<T, V>& r) {
  if constexpr (sizeof(T) * V == 16) {
    *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
  } else if constexpr (sizeof(T) * V == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
  } else if constexpr (sizeof(T) * V == 4) {
    *reinterpret_cast<uint32_t*>(p) = r.w[0];
  } else {
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(r.w[0]);
  }
}

// Element j of a Raw as fp32, and the rounding of an fp32 value into element j (set in increasing j from a zeroed
// Raw: the odd 16-bit element is or-ed into the word its even neighbour started).
template <typename T, int V>
__device__ __forceinline__ float get(const Raw<T, V>& r, int j) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(r.w[j]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = r.w[j / 2];
    return __uint_as_float(j % 2 == 0 ? w << 16 : w & 0xffff0000u);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(r.w[j / 2] >> (16 * (j % 2)))));
  }
}

template <typename T, int V>
__device__ __forceinline__ void set(Raw<T, V>& r, int j, float v) {
  if constexpr (sizeof(T) == 4) {
    r.w[j] = __float_as_uint(v);
  } else {
    uint32_t bits;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    else bits = __half_as_ushort(__float2half_rn(v));
    r.w[j / 2] = j % 2 == 0 ? bits : (r.w[j / 2] | (bits << 16));
  }
}

// 16 bytes of T.
template <typename T> constexpr int kVec = 16 / sizeof(T);

// The activations in fp32, mlpfuse.activations' math. gelu_tanh's 0.5·(1 + tanh(a)) is σ(2a): one exponential.
// relu is written as x < 0 ? 0 : x so that NaN stays NaN, as in PyTorch. σ divides with __fdividef (2 ulp, and 0 for
// an infinite denominator, which is σ's limit): an IEEE division is a multi-instruction sequence per element, and
// the backward needs σ for every element it streams.
__device__ __forceinline__ float sigmoid(float z) { return __fdividef(1.0f, 1.0f + __expf(-z)); }

__device__ __forceinline__ float gelu_tanh_sigma(float x) {  // σ(2a), a = √(2/π)·(x + 0.044715·x³)
  return sigmoid(2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x));
}

template <int ACT>
__device__ __forceinline__ float act_fwd(float x) {
  if constexpr (ACT == GELU_TANH) {
    return x * gelu_tanh_sigma(x);
  } else if constexpr (ACT == GELU) {
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
  } else if constexpr (ACT == SILU) {
    return x * sigmoid(x);
  } else if constexpr (ACT == RELU) {
    return x < 0.0f ? 0.0f : x;
  } else if constexpr (ACT == RELU2) {
    const float r = x < 0.0f ? 0.0f : x;
    return r * r;
  } else if constexpr (ACT == QUICK_GELU) {
    return x * sigmoid(1.702f * x);
  } else {
    return x;
  }
}

// act(x) and act'(x) together (the backward's only use of the derivative): they share their exponential or erf.
template <int ACT>
__device__ __forceinline__ void act_fwd_grad(float x, float& a, float& da) {
  if constexpr (ACT == GELU_TANH) {
    const float s = gelu_tanh_sigma(x);
    a = x * s;
    da = s + 2.0f * x * s * (1.0f - s) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);
  } else if constexpr (ACT == GELU) {
    const float cdf = 0.5f * (1.0f + erff(x * 0.7071067811865476f));
    a = x * cdf;
    da = cdf + x * __expf(-0.5f * x * x) * 0.3989422804014327f;
  } else if constexpr (ACT == SILU) {
    const float s = sigmoid(x);
    a = x * s;
    da = s * (1.0f + x * (1.0f - s));
  } else if constexpr (ACT == RELU) {
    a = act_fwd<ACT>(x);
    da = x > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (ACT == RELU2) {
    a = act_fwd<ACT>(x);
    da = x > 0.0f ? 2.0f * x : 0.0f;
  } else if constexpr (ACT == QUICK_GELU) {
    const float s = sigmoid(1.702f * x);
    a = x * s;
    da = s * (1.0f + 1.702f * x * (1.0f - s));
  } else {
    a = x;
    da = 1.0f;
  }
}

// Runtime activation id -> a call with the id as a template argument (one compiled body per activation).
template <typename F>
inline void with_act(int act, F&& f) {
  switch (act) {
    case GELU_TANH: f(std::integral_constant<int, GELU_TANH>{}); break;
    case GELU: f(std::integral_constant<int, GELU>{}); break;
    case SILU: f(std::integral_constant<int, SILU>{}); break;
    case RELU: f(std::integral_constant<int, RELU>{}); break;
    case RELU2: f(std::integral_constant<int, RELU2>{}); break;
    case QUICK_GELU: f(std::integral_constant<int, QUICK_GELU>{}); break;
    default: f(std::integral_constant<int, IDENTITY>{}); break;
  }
}

// Runtime dtype -> a call with the element type.
template <typename F>
inline void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f16: f(__half{}); break;
    case DType::bf16: f(__nv_bfloat16{}); break;
    default: f(float{}); break;
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Programmatic dependent launch (sm_90): a kernel launched with it may start while the kernel before it in the
// stream is still running, once every block of that one has called grid_dependents_may_launch (or exited). The
// dependent does what needs nothing from its predecessor first (weights it streams, which no kernel of the pair
// writes), then grid_dependency_wait: that returns once the predecessor has completed and its writes are visible.
// Both are no-ops for a kernel launched the ordinary way and on older GPUs, so a kernel can be launched either way.
__device__ __forceinline__ void grid_dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A fact about the current device, found once per device: ask(device) runs the first time; Tag keeps each fact's
// answers apart. false where the device cannot be named.
template <class Tag, class Ask>
bool per_device(Ask ask) {
  constexpr int kDevices = 64;
  static std::atomic<signed char> known[kDevices];  // 0: not yet asked, 1: yes, -1: no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) {
    cudaGetLastError();
    return false;
  }
  signed char k = known[dev].load(std::memory_order_relaxed);
  if (k == 0) {
    k = ask(dev) ? 1 : -1;
    cudaGetLastError();
    known[dev].store(k, std::memory_order_relaxed);
  }
  return k > 0;
}

inline bool compute_major_at_least(int dev, int major) {
  int m = 0;
  return cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && m >= major;
}

// Whether the current device takes programmatic dependent launches: sm_90 or newer, and a driver that also
// records them in CUDA graphs (12.3), so that a captured call behaves as an uncaptured one.
inline bool dependent_launch_supported() {
  return per_device<struct DependentLaunch>([](int dev) {
    int driver = 0;
    return compute_major_at_least(dev, 9) && cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12030;
  });
}

// Whether the current device has the bulk copy engine and transaction-counting mbarriers (sm_90 or newer).
inline bool bulk_copy_supported() {
  return per_device<struct BulkCopy>([](int dev) { return compute_major_at_least(dev, 9); });
}

// Lets Kernel take `bytes` of dynamic shared memory (past the default 48 KiB) on the current device; false if the
// device refuses.
template <auto Kernel>
bool allow_shared_memory(size_t bytes) {
  return per_device<std::integral_constant<decltype(Kernel), Kernel>>([bytes](int) {
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) ==
           cudaSuccess;
  });
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the stream's previous kernel where the
// device supports it; an ordinary launch otherwise, or if the runtime refuses the attribute.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args... args) {
  if (dependent_launch_supported()) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    if (cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...) == cudaSuccess) return;
    cudaGetLastError();  // not sticky: clear it so that the caller's launch check sees the launch below
  }
  kernel<<<grid, block, smem, stream>>>(static_cast<Params>(args)...);
}

}  // namespace mlpfuse
