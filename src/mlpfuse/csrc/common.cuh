// Device helpers shared by mlpfuse's CUDA kernels: element conversions, 16-byte vectors, the activations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
// are bound by memory bandwidth, and narrower accesses leave part of it unused.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
  Vec<T, V> t = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(t.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[V]) {
  Vec<T, V> t;
#pragma unroll
  for (int i = 0; i < V; ++i) t.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, V>*>(p) = t;
}

// 16 bytes of T.
template <typename T> constexpr int kVec = 16 / sizeof(T);

// The activations in fp32, mlpfuse.activations' math. gelu_tanh's 0.5·(1 + tanh(a)) is σ(2a): one exponential.
// relu is written as x < 0 ? 0 : x so that NaN stays NaN, as in PyTorch.
__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + __expf(-z)); }

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
  } else {
    return x;
  }
}

template <int ACT>
__device__ __forceinline__ float act_grad(float x) {
  if constexpr (ACT == GELU_TANH) {
    // With s = σ(2a): 0.5·(1 + t) = s and 0.5·(1 − t²) = 2·s·(1 − s), t = tanh(a).
    const float s = gelu_tanh_sigma(x);
    return s + 2.0f * x * s * (1.0f - s) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);
  } else if constexpr (ACT == GELU) {
    return 0.5f * (1.0f + erff(x * 0.7071067811865476f)) + x * __expf(-0.5f * x * x) * 0.3989422804014327f;
  } else if constexpr (ACT == SILU) {
    const float s = sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
  } else if constexpr (ACT == RELU) {
    return x > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (ACT == RELU2) {
    return x > 0.0f ? 2.0f * x : 0.0f;
  } else {
    return 1.0f;
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

}  // namespace mlpfuse
