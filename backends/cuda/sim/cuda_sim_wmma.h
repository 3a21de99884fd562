// cuda_sim_wmma.h: the WMMA API (nvcuda::wmma, <mma.h>), bfloat16 and the cuda_pipeline async
// copies, emulated on the host. Included by cuda_sim_shim.h.
//
// A fragment is opaque in CUDA: which lane holds which element is unspecified. Here lane l holds the
// elements l, l + 32, l + 64, ... of the fragment's matrix in row-major order. load_matrix_sync and
// store_matrix_sync are warp collectives (every lane waits for the warp, then moves its own
// elements); mma_sync gathers A and B from all lanes through warp exchanges, and each lane computes
// its own accumulator elements, summing k in order with float32 fma from the accumulator's value.
// Products of tf32, fp16 and bf16 values are exact in float32, so that matches the hardware up to
// the order of the float32 sums. tf32 inputs are truncated to tf32 inside mma_sync, as the tensor
// cores read only the top 19 bits. Async copies are deferred to the wait that needs them.
#pragma once

// bfloat16: float32's upper half, narrowing rounded to nearest even (NaN stays a quiet NaN).
struct __nv_bfloat16 {
    uint16_t bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : bits(from_float(f)) {}
    operator float() const { return to_float(bits); }
    static uint16_t from_float(float f) {
        uint32_t x; std::memcpy(&x, &f, 4);
        if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
        x += 0x7fffu + ((x >> 16) & 1u);
        return static_cast<uint16_t>(x >> 16);
    }
    static float to_float(uint16_t b) {
        uint32_t x = static_cast<uint32_t>(b) << 16; float f; std::memcpy(&f, &x, 4); return f;
    }
};
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }
using half = __half;

// cuda_pipeline: a copy waits in the thread's queue (ThreadState::pipeline) until a wait needs its
// batch; wait_prior(n) completes every copy of the batches committed before the newest n, in issue
// order. A full queue does its oldest copy early, which a GPU may do too.
inline void pipeline_complete(cuda_sim::PendingCopy& c) {
    std::memcpy(c.dst, c.src, c.bytes - c.zfill);
    std::memset(static_cast<char*>(c.dst) + (c.bytes - c.zfill), 0, c.zfill);
}
inline void __pipeline_memcpy_async(void* dst_shared, const void* src_global, std::size_t size_and_align,
                                    std::size_t zfill = 0) {
    cuda_sim::PipelineQueue& q = cuda_sim::current->pipeline;
    if (q.count == CUDA_SIM_PIPELINE_COPIES) {
        pipeline_complete(q.copies[0]);
        std::memmove(q.copies, q.copies + 1, (q.count - 1) * sizeof(cuda_sim::PendingCopy));
        --q.count;
    }
    q.copies[q.count++] = {dst_shared, src_global, static_cast<unsigned int>(size_and_align),
                           static_cast<unsigned int>(zfill), q.committed};
}
inline void __pipeline_commit() { ++cuda_sim::current->pipeline.committed; }
inline void __pipeline_wait_prior(std::size_t prior) {
    cuda_sim::PipelineQueue& q = cuda_sim::current->pipeline;
    unsigned int done = 0;
    while (done < q.count && q.copies[done].batch + prior < q.committed) pipeline_complete(q.copies[done++]);
    std::memmove(q.copies, q.copies + done, (q.count - done) * sizeof(cuda_sim::PendingCopy));
    q.count -= done;
}

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision { struct tf32 {}; }

// tf32 as CUDA's __float_to_tf32 rounds (cvt.rna.tf32.f32): to nearest, ties away from zero.
inline float __float_to_tf32(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    if ((x & 0x7f800000u) != 0x7f800000u) x = (x + 0x1000u) & 0xffffe000u;
    std::memcpy(&f, &x, 4);
    return f;
}
inline float tf32_truncate(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    if ((x & 0x7f800000u) != 0x7f800000u) x &= 0xffffe000u;
    std::memcpy(&f, &x, 4);
    return f;
}

template <class T> struct storage { using type = T; };
template <> struct storage<precision::tf32> { using type = float; };

template <class Use, int M, int N, int K> struct shape;
template <int M, int N, int K> struct shape<matrix_a, M, N, K> { static constexpr int rows = M, cols = K; };
template <int M, int N, int K> struct shape<matrix_b, M, N, K> { static constexpr int rows = K, cols = N; };
template <int M, int N, int K> struct shape<accumulator, M, N, K> { static constexpr int rows = M, cols = N; };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    using element_type = typename storage<T>::type;
    static constexpr int rows = shape<Use, M, N, K>::rows, cols = shape<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols / 32;
    static_assert(rows * cols % 32 == 0, "a fragment spreads evenly over the warp's lanes");
    element_type x[num_elements];
};

inline unsigned int lane() { return cuda_sim::current->lane; }

template <class F> inline int element_offset(int element, unsigned ldm, bool row_major_memory) {
    int index = static_cast<int>(lane()) + 32 * element, r = index / F::cols, c = index % F::cols;
    return row_major_memory ? r * static_cast<int>(ldm) + c : c * static_cast<int>(ldm) + r;
}

template <class Use, int M, int N, int K, class T, class L, class P>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
    using F = fragment<Use, M, N, K, T, L>;
    cuda_sim::warp_barrier(0xffffffffu);
    for (int e = 0; e < F::num_elements; ++e)
        f.x[e] = static_cast<typename F::element_type>(p[element_offset<F>(e, ldm, !std::is_same_v<L, col_major>)]);
}
template <int M, int N, int K, class P>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const P* p, unsigned ldm, layout_t layout) {
    using F = fragment<accumulator, M, N, K, float>;
    cuda_sim::warp_barrier(0xffffffffu);
    for (int e = 0; e < F::num_elements; ++e) f.x[e] = p[element_offset<F>(e, ldm, layout == mem_row_major)];
}
template <int M, int N, int K>
inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
    using F = fragment<accumulator, M, N, K, float>;
    cuda_sim::warp_barrier(0xffffffffu);
    for (int e = 0; e < F::num_elements; ++e) p[element_offset<F>(e, ldm, layout == mem_row_major)] = f.x[e];
    cuda_sim::warp_barrier(0xffffffffu);
}
template <class Use, int M, int N, int K, class T, class L, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& v) {
    for (auto& e : f.x) e = static_cast<typename fragment<Use, M, N, K, T, L>::element_type>(v);
}

// The whole matrix of a fragment, row-major, gathered from every lane of the warp.
template <class F> inline void gather(const F& f, float* matrix, bool is_tf32) {
    for (int e = 0; e < F::num_elements; ++e) {
        float mine = static_cast<float>(f.x[e]);
        if (is_tf32) mine = tf32_truncate(mine);
        const uint64_t* slots = cuda_sim::exchange(0xffffffffu, mine);
        for (int l = 0; l < 32; ++l) std::memcpy(&matrix[l + 32 * e], &slots[l], sizeof(float));
    }
}

template <int M, int N, int K, class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
                     const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
    constexpr bool is_tf32 = std::is_same_v<T, precision::tf32>;
    float a_all[M * K], b_all[K * N];
    gather(a, a_all, is_tf32);
    gather(b, b_all, is_tf32);
    for (int e = 0; e < M * N / 32; ++e) {
        int index = static_cast<int>(lane()) + 32 * e, r = index / N, col = index % N;
        float sum = c.x[e];
        for (int k = 0; k < K; ++k) sum = fmaf(a_all[r * K + k], b_all[k * N + col], sum);
        d.x[e] = sum;
    }
}

}  // namespace wmma
}  // namespace nvcuda
