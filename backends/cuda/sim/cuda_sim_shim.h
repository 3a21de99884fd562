// cuda_sim_shim.h: compiles a CUDA C++ translation unit as host C++ (force-included with
// `-include`), so the unchanged .cu that Cortex generates can run on the CPU under cuda-sim.
//
// What it maps: the execution-space qualifiers disappear; `__shared__` becomes `thread_local`, which
// is per block because the blocks a host thread runs run one at a time, each CUDA thread of a block
// being a fiber on that host thread (cuda_sim_runtime.cpp); threadIdx/blockIdx/blockDim/gridDim read
// the running fiber's state; barriers, shuffles and votes are cooperative points where fibers yield.
// The WMMA API and cuda_pipeline's async copies are emulated (cuda_sim_wmma.h). What it refuses:
// inline PTX (the mma.sync, wgmma and cp.async instructions with it), cuda::memcpy_async/barrier (TMA)
// and grid-wide sync; sim.py rejects a source whose active code uses them before compiling it.
#pragma once

// Standard headers first, before any macro below could touch them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define CUDA_SIM 1

#define __global__
#define __device__
#define __host__
#define __constant__
#define __shared__ thread_local
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Vector types with CUDA's size and alignment, for vectorised loads.
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

namespace cuda_sim {

// cuda_pipeline copies a thread issued and has not waited for: each belongs to a batch (the number
// of commits before it). They are done only when a wait needs them (cuda_sim_wmma.h), the latest a GPU
// may do them, so a kernel that reads a stage before its wait reads the stale shared memory.
#ifndef CUDA_SIM_PIPELINE_COPIES
#define CUDA_SIM_PIPELINE_COPIES 128
#endif
struct PendingCopy { void* dst; const void* src; unsigned int bytes, zfill, batch; };
struct PipelineQueue {
    PendingCopy copies[CUDA_SIM_PIPELINE_COPIES];
    unsigned int count;           // pending copies, oldest first
    unsigned int committed;       // commits so far: the batch of the copies issued now
};

// The state of one CUDA thread (one fiber). `current` points at the running fiber's.
struct ThreadState {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned int lane;            // index within the warp
    unsigned int exchange_count;  // warp exchanges so far: picks the exchange buffer (double-buffered)
    struct Warp* warp;
    PipelineQueue pipeline;       // this thread's cuda_pipeline copies not yet waited for
};

struct Warp {
    unsigned int alive;           // lanes that exist and have not returned
    unsigned int arrived;         // lanes released together by the last warp barrier
    uint64_t slots[2][32];        // values deposited by lanes for a shuffle or vote
};

extern thread_local ThreadState* current;

// Implemented in cuda_sim_runtime.cpp: both yield the running fiber until the barrier releases.
void block_barrier();
void warp_barrier(unsigned int mask);

// Deposit `value` for this lane, wait for the lanes of `mask`, return the exchange buffer.
template <class T>
inline const uint64_t* exchange(unsigned int mask, T value) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "warp exchange of a type wider than 64 bits");
    ThreadState* t = current;
    uint64_t* slots = t->warp->slots[t->exchange_count++ & 1];
    uint64_t word = 0;
    std::memcpy(&word, &value, sizeof(T));
    slots[t->lane] = word;
    warp_barrier(mask);
    return slots;
}

template <class T>
inline T shuffle_from(unsigned int mask, T value, int src_lane, bool in_range) {
    const uint64_t* slots = exchange(mask, value);
    ThreadState* t = current;
    if (!in_range || src_lane < 0 || src_lane >= 32 || !((t->warp->arrived >> src_lane) & 1u)) return value;
    T result;
    std::memcpy(&result, &slots[src_lane], sizeof(T));
    return result;
}

inline unsigned int ballot(unsigned int mask, int predicate) {
    const uint64_t* slots = exchange(mask, static_cast<uint64_t>(predicate != 0));
    unsigned int participants = mask & current->warp->arrived, bits = 0;
    for (int lane = 0; lane < 32; ++lane)
        if (((participants >> lane) & 1u) && slots[lane]) bits |= 1u << lane;
    return bits;
}

}  // namespace cuda_sim

#define threadIdx (cuda_sim::current->thread_idx)
#define blockIdx (cuda_sim::current->block_idx)
#define blockDim (cuda_sim::current->block_dim)
#define gridDim (cuda_sim::current->grid_dim)
constexpr int warpSize = 32;

// Synchronisation.
inline void __syncthreads() { cuda_sim::block_barrier(); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) { cuda_sim::warp_barrier(mask); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int __activemask() { return cuda_sim::current->warp->alive; }

// Shuffles, with CUDA's rules for `width` segments (CUDA C++ Programming Guide, warp shuffle functions).
template <class T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32) {
    int lane = static_cast<int>(cuda_sim::current->lane), base = lane & ~(width - 1);
    return cuda_sim::shuffle_from(mask, var, base + (src_lane & (width - 1)), true);
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    int lane = static_cast<int>(cuda_sim::current->lane);
    return cuda_sim::shuffle_from(mask, var, lane - static_cast<int>(delta), (lane & (width - 1)) >= static_cast<int>(delta));
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    int lane = static_cast<int>(cuda_sim::current->lane);
    return cuda_sim::shuffle_from(mask, var, lane + static_cast<int>(delta), (lane & (width - 1)) + static_cast<int>(delta) < width);
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
    int lane = static_cast<int>(cuda_sim::current->lane), src = lane ^ lane_mask;
    // A lane may read from its own or an earlier segment; a later segment gives back its own value.
    return cuda_sim::shuffle_from(mask, var, src, src < (lane & ~(width - 1)) + width);
}

// Votes.
inline unsigned int __ballot_sync(unsigned int mask, int predicate) { return cuda_sim::ballot(mask, predicate); }
inline int __any_sync(unsigned int mask, int predicate) { return cuda_sim::ballot(mask, predicate) != 0; }
inline int __all_sync(unsigned int mask, int predicate) {
    return cuda_sim::ballot(mask, predicate) == (mask & cuda_sim::current->warp->arrived);
}

// Atomics: real atomics, since blocks run on several host threads at once.
template <class T> inline T atomicAdd(T* address, T value) { return std::atomic_ref<T>(*address).fetch_add(value); }
template <class T> inline T atomicSub(T* address, T value) { return std::atomic_ref<T>(*address).fetch_sub(value); }
template <class T> inline T atomicExch(T* address, T value) { return std::atomic_ref<T>(*address).exchange(value); }
template <class T> inline T atomicCAS(T* address, T compare, T value) {
    std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
    return compare;
}
template <class T> inline T atomicMax(T* address, T value) {
    std::atomic_ref<T> a(*address);
    T old = a.load();
    while (old < value && !a.compare_exchange_weak(old, value)) {}
    return old;
}
template <class T> inline T atomicMin(T* address, T value) {
    std::atomic_ref<T> a(*address);
    T old = a.load();
    while (value < old && !a.compare_exchange_weak(old, value)) {}
    return old;
}

// Integer and float helpers that CUDA provides as overloads or intrinsics.
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
template <class T> inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int __mul24(int a, int b) { return a * b; }
// Four byte products added to c: signed bytes, or unsigned bytes (sm_61 and newer).
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 32; i += 8) c += static_cast<int>(static_cast<signed char>(a >> i)) * static_cast<signed char>(b >> i);
    return c;
}
inline unsigned int __dp4a(unsigned int a, unsigned int b, unsigned int c) {
    for (int i = 0; i < 32; i += 8) c += ((a >> i) & 0xffu) * ((b >> i) & 0xffu);
    return c;
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int x; std::memcpy(&x, &f, 4); return x; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double d) { long long x; std::memcpy(&x, &d, 8); return x; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float exp10f(float x) { return powf(10.0f, x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }

// __half: storage as binary16, arithmetic through float (what sm_80 does for scalar half math).
struct __half {
    uint16_t bits;
    __half() = default;
    __half(float f) : bits(from_float(f)) {}
    operator float() const { return to_float(bits); }
    static uint16_t from_float(float f) {
        _Float16 h = static_cast<_Float16>(f);
        uint16_t b; std::memcpy(&b, &h, 2); return b;
    }
    static float to_float(uint16_t b) {
        _Float16 h; std::memcpy(&h, &b, 2); return static_cast<float>(h);
    }
};
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half __hadd(__half a, __half b) { return __half(float(a) + float(b)); }
inline __half __hmul(__half a, __half b) { return __half(float(a) * float(b)); }
inline __half __hfma(__half a, __half b, __half c) { return __half(fmaf(float(a), float(b), float(c))); }

// Exports of a loaded module (generated after the source by sim.py, see CUDA_SIM_EXPORT_KERNEL).
namespace cuda_sim {

struct LaunchConfig {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_bytes;     // dynamic shared memory, as in cuLaunchKernel
    unsigned int host_threads;     // host threads that run blocks at once (0: one)
    unsigned long long seed;       // 0: blocks and fibers in order; else a permutation seeded by it
};

using BlockBody = void (*)(void* context);
int run_grid(const LaunchConfig& config, BlockBody body, void* context);
int register_dynamic_shared(void* (*address)(), unsigned long long capacity);

template <class T> constexpr const char* type_code() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return "ptr";
    else if constexpr (std::is_same_v<U, float>) return "f32";
    else if constexpr (std::is_same_v<U, double>) return "f64";
    else if constexpr (std::is_same_v<U, bool>) return "bool";
    else if constexpr (std::is_integral_v<U> && std::is_signed_v<U>) return sizeof(U) == 8 ? "i64" : sizeof(U) == 4 ? "i32" : sizeof(U) == 2 ? "i16" : "i8";
    else if constexpr (std::is_integral_v<U>) return sizeof(U) == 8 ? "u64" : sizeof(U) == 4 ? "u32" : sizeof(U) == 2 ? "u16" : "u8";
    else return "struct";
}

// The parameter types of a kernel, comma separated ("ptr,ptr,i32"), for sim.py to pack arguments.
template <class... A> const char* signature(void (*)(A...)) {
    static const std::string text = [] {
        std::string s;
        ((s += (s.empty() ? "" : ","), s += type_code<A>()), ...);
        return s;
    }();
    return text.c_str();
}

// Like cuLaunchKernel: `params[i]` points at the value of parameter i, copied before the launch.
template <class... A, std::size_t... I>
int launch_kernel(void (*kernel)(A...), const LaunchConfig& config, void** params, std::index_sequence<I...>) {
    using Args = std::tuple<std::decay_t<A>...>;
    Args args{*static_cast<std::decay_t<A>*>(params[I])...};
    struct Bound { void (*kernel)(A...); Args* args; } bound{kernel, &args};
    return run_grid(config, [](void* raw) {
        auto* b = static_cast<Bound*>(raw);
        std::apply(b->kernel, *b->args);
    }, &bound);
}
template <class... A> int launch_kernel(void (*kernel)(A...), const LaunchConfig& config, void** params) {
    return launch_kernel(kernel, config, params, std::index_sequence_for<A...>{});
}

}  // namespace cuda_sim

#define CUDA_SIM_EXPORT_KERNEL(name)                                                                     \
    extern "C" __attribute__((visibility("default"))) int cuda_sim_launch_##name(                        \
        const cuda_sim::LaunchConfig* config, void** params) {                                           \
        return cuda_sim::launch_kernel(name, *config, params);                                           \
    }                                                                                                    \
    extern "C" __attribute__((visibility("default"))) const char* cuda_sim_signature_##name() {         \
        return cuda_sim::signature(name);                                                                \
    }

// Gives an `extern __shared__ T name[];` its storage: the largest dynamic shared memory a block may ask
// for (227 KiB on sm_80/sm_90); the runtime fills the launched size with a NaN pattern per block and,
// under AddressSanitizer, poisons the rest.
#define CUDA_SIM_MAX_DYNAMIC_SHARED 232448
#define CUDA_SIM_DYNAMIC_SHARED(type, name)                                                              \
    thread_local type name[CUDA_SIM_MAX_DYNAMIC_SHARED / sizeof(type)] __attribute__((aligned(16)));    \
    static int cuda_sim_registered_##name = cuda_sim::register_dynamic_shared(                           \
        [] { return static_cast<void*>(name); }, sizeof(name));

// Tensor cores (WMMA), bfloat16 and cuda_pipeline's async copies.
#include "cuda_sim_wmma.h"
