// cuda_sim_runtime.cpp: the fiber scheduler and grid launcher behind cuda_sim_shim.h.
//
// Each host thread takes blocks one at a time; a block's CUDA threads are fibers on that host thread,
// switched by a hand-written x86-64 context switch (5-6x faster than ucontext; one OS thread per CUDA
// thread would be 30-100x slower). A fiber runs until it reaches a barrier (__syncthreads, __syncwarp,
// a shuffle or a vote) or returns; the scheduler releases a barrier once every live thread it waits
// for has arrived, and reports a deadlock when threads wait at barriers that can never release.
// A non-zero seed permutes the order of blocks and, at each release, of fibers, to expose missing
// barriers.
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_SIM_ASAN 1
#endif

#ifndef CUDA_SIM_FIBER_STACK_BYTES
#define CUDA_SIM_FIBER_STACK_BYTES (256 * 1024)
#endif

namespace cuda_sim {

thread_local ThreadState* current = nullptr;

enum class FiberState { runnable, at_block_barrier, at_warp_barrier, done };

struct Fiber {
    ThreadState state;
    FiberState status;
    unsigned int wait_mask;    // lanes a warp barrier waits for
    void* sp;                  // saved stack pointer while switched out
    char* stack;               // lowest usable byte (a guard page sits below it)
#ifdef CUDA_SIM_ASAN
    void* fake_stack;
#endif
};

namespace {

struct DynamicShared { void* (*address)(); unsigned long long capacity; };
std::vector<DynamicShared>& dynamic_shared_regions() {
    static std::vector<DynamicShared> regions;
    return regions;
}

}  // namespace

struct Worker;
thread_local Worker* worker = nullptr;

namespace {

// This module's thread-local storage on the calling host thread. Every `__shared__` variable lives
// there (the shim makes it `thread_local`), so refilling it gives each block fresh, NaN-patterned shared
// memory, as garbage as a GPU's, instead of what the previous block left.
struct TlsBlock { char* base = nullptr; size_t size = 0; };

TlsBlock module_tls() {
    static char anchor;
    struct Search { uintptr_t load_base; TlsBlock found; } search{};
    Dl_info info;
    if (!dladdr(&anchor, &info)) return {};
    search.load_base = reinterpret_cast<uintptr_t>(info.dli_fbase);
    (void)current;  // makes sure this thread's block is allocated before asking where it is
    dl_iterate_phdr([](dl_phdr_info* phdr, size_t, void* raw) -> int {
        auto* s = static_cast<Search*>(raw);
        for (int i = 0; i < phdr->dlpi_phnum; ++i) {
            const ElfW(Phdr)& h = phdr->dlpi_phdr[i];
            if (h.p_type != PT_TLS || !phdr->dlpi_tls_data) continue;
            uintptr_t lo = phdr->dlpi_addr;
            if (lo != s->load_base) continue;
            s->found = {static_cast<char*>(phdr->dlpi_tls_data), h.p_memsz};
            return 1;
        }
        return 0;
    }, &search);
    return search.found;
}

}  // namespace

extern "C" void cuda_sim_switch(void** save_sp, void* next_sp);
extern "C" void cuda_sim_fiber_trampoline();
extern "C" void cuda_sim_fiber_main(Fiber* fiber);

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word on the old stack, stores its
// stack pointer in *save_sp, and restores the same from next_sp (System V AMD64 ABI).
asm(R"(
    .pushsection .text
    .globl cuda_sim_switch
    .hidden cuda_sim_switch
    .type cuda_sim_switch, @function
cuda_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_sim_switch, .-cuda_sim_switch

    .globl cuda_sim_fiber_trampoline
    .hidden cuda_sim_fiber_trampoline
    .type cuda_sim_fiber_trampoline, @function
cuda_sim_fiber_trampoline:
    movq %r12, %rdi
    call cuda_sim_fiber_main
    ud2
    .size cuda_sim_fiber_trampoline, .-cuda_sim_fiber_trampoline
    .popsection
)");
#else
#error "cuda-sim's fiber switch is written for x86-64"
#endif

struct Worker {
    const LaunchConfig* config;
    BlockBody body;
    void* context;
    void* scheduler_sp = nullptr;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<char*> mappings;
    std::mt19937_64 rng;
    std::string error;
    TlsBlock tls;
#ifdef CUDA_SIM_ASAN
    const void* scheduler_stack_bottom = nullptr;
    size_t scheduler_stack_size = 0;
    void* scheduler_fake_stack = nullptr;
#endif

    static constexpr size_t page = 4096;

    ~Worker() {
        for (char* m : mappings) munmap(m, CUDA_SIM_FIBER_STACK_BYTES + page);
    }

    bool prepare(unsigned int threads) {
        while (mappings.size() < threads) {
            void* m = mmap(nullptr, CUDA_SIM_FIBER_STACK_BYTES + page, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) { error = "cannot map fiber stacks"; return false; }
            mprotect(m, page, PROT_NONE);  // a guard page: a stack overflow faults instead of corrupting
            mappings.push_back(static_cast<char*>(m));
        }
        fibers.resize(threads);
        warps.resize((threads + 31) / 32);
        return true;
    }

    void start_fiber(Fiber& f, unsigned int linear, const uint3& block_idx) {
        const LaunchConfig& c = *config;
        unsigned int bx = c.block[0], by = c.block[1];
        f.state.thread_idx = {linear % bx, (linear / bx) % by, linear / (bx * by)};
        f.state.block_idx = block_idx;
        f.state.block_dim = dim3(c.block[0], c.block[1], c.block[2]);
        f.state.grid_dim = dim3(c.grid[0], c.grid[1], c.grid[2]);
        f.state.lane = linear % 32;
        f.state.exchange_count = 0;
        f.state.pipeline.count = f.state.pipeline.committed = 0;
        f.state.warp = &warps[linear / 32];
        f.status = FiberState::runnable;
        f.stack = mappings[linear] + page;
#ifdef CUDA_SIM_ASAN
        __asan_unpoison_memory_region(f.stack, CUDA_SIM_FIBER_STACK_BYTES);
        f.fake_stack = nullptr;
#endif
        // The first switch into the fiber pops this frame: MXCSR and x87 control word, r15..r12,
        // rbx, rbp, then "returns" into the trampoline with r12 = the fiber. The return address sits
        // at an address that is 8 mod 16, so the trampoline calls with a 16-byte-aligned stack.
        uint64_t* top = reinterpret_cast<uint64_t*>(f.stack + CUDA_SIM_FIBER_STACK_BYTES);
        uint64_t* frame = top - 8;
        uint32_t mxcsr; uint16_t fpucw;
        asm volatile("stmxcsr %0" : "=m"(mxcsr));
        asm volatile("fnstcw %0" : "=m"(fpucw));
        frame[0] = mxcsr | (static_cast<uint64_t>(fpucw) << 32);
        frame[1] = frame[2] = frame[3] = 0;                     // r15, r14, r13
        frame[4] = reinterpret_cast<uint64_t>(&f);              // r12
        frame[5] = frame[6] = 0;                                // rbx, rbp
        frame[7] = reinterpret_cast<uint64_t>(&cuda_sim_fiber_trampoline);
        f.sp = frame;
    }

    void resume(Fiber& f) {
        current = &f.state;
#ifdef CUDA_SIM_ASAN
        __sanitizer_start_switch_fiber(&scheduler_fake_stack, f.stack, CUDA_SIM_FIBER_STACK_BYTES);
#endif
        cuda_sim_switch(&scheduler_sp, f.sp);
#ifdef CUDA_SIM_ASAN
        __sanitizer_finish_switch_fiber(scheduler_fake_stack, nullptr, nullptr);
#endif
        current = nullptr;
    }

    void run_block(const uint3& block_idx) {
        const LaunchConfig& c = *config;
        unsigned int n = c.block[0] * c.block[1] * c.block[2];
        for (size_t w = 0; w < warps.size(); ++w) {
            unsigned int lanes = std::min(32u, n - static_cast<unsigned int>(w) * 32);
            warps[w].alive = warps[w].arrived = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
        }
        for (unsigned int i = 0; i < n; ++i) start_fiber(fibers[i], i, block_idx);
        if (tls.base) {
            Worker* self = worker;  // the runtime's own thread-locals live in the same block
            std::memset(tls.base, 0xff, tls.size);
            worker = self;
            current = nullptr;
        }
        for (const DynamicShared& region : dynamic_shared_regions()) {
            char* base = static_cast<char*>(region.address());
#ifdef CUDA_SIM_ASAN
            __asan_unpoison_memory_region(base, region.capacity);
            if (c.shared_bytes < region.capacity)
                __asan_poison_memory_region(base + c.shared_bytes, region.capacity - c.shared_bytes);
#endif
        }
        std::vector<unsigned int> order(n);
        for (unsigned int i = 0; i < n; ++i) order[i] = i;
        for (;;) {
            if (c.seed) std::shuffle(order.begin(), order.end(), rng);
            for (unsigned int i : order)
                if (fibers[i].status == FiberState::runnable) resume(fibers[i]);
            if (!release_barriers(n)) return;
        }
    }

    // Returns false once every fiber is done (or on a deadlock, with `error` set).
    bool release_barriers(unsigned int n) {
        bool any_live = false, released = false, all_at_block = true;
        for (size_t w = 0; w < warps.size(); ++w) {
            unsigned int waiting = 0, needed = 0;
            for (unsigned int lane = 0; lane < 32 && w * 32 + lane < n; ++lane) {
                const Fiber& f = fibers[w * 32 + lane];
                if (f.status == FiberState::done) continue;
                any_live = true;
                if (f.status != FiberState::at_block_barrier) all_at_block = false;
                if (f.status == FiberState::at_warp_barrier) { waiting |= 1u << lane; needed |= f.wait_mask; }
            }
            needed &= warps[w].alive;
            if (waiting && (needed & ~waiting) == 0) {
                warps[w].arrived = waiting;
                for (unsigned int lane = 0; lane < 32; ++lane)
                    if ((waiting >> lane) & 1u) fibers[w * 32 + lane].status = FiberState::runnable;
                released = true;
            }
        }
        if (!any_live) return false;
        if (released) return true;
        if (all_at_block) {
            for (unsigned int i = 0; i < n; ++i)
                if (fibers[i].status == FiberState::at_block_barrier) fibers[i].status = FiberState::runnable;
            return true;
        }
        error = "deadlock: the threads of a block wait at different barriers (a __syncthreads or a "
                "warp-synchronous call not reached by every thread it waits for)";
        return false;
    }

    void yield(FiberState status, unsigned int mask) {
        Fiber* f = reinterpret_cast<Fiber*>(current);
        f->status = status;
        f->wait_mask = mask;
#ifdef CUDA_SIM_ASAN
        __sanitizer_start_switch_fiber(&f->fake_stack, scheduler_stack_bottom, scheduler_stack_size);
#endif
        cuda_sim_switch(&f->sp, scheduler_sp);
#ifdef CUDA_SIM_ASAN
        __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
    }
};

extern "C" __attribute__((used)) void cuda_sim_fiber_main(Fiber* fiber) {
    Worker* w = worker;
#ifdef CUDA_SIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &w->scheduler_stack_bottom, &w->scheduler_stack_size);
#endif
    w->body(w->context);
    fiber->status = FiberState::done;
    fiber->state.warp->alive &= ~(1u << fiber->state.lane);
#ifdef CUDA_SIM_ASAN
    __sanitizer_start_switch_fiber(nullptr, w->scheduler_stack_bottom, w->scheduler_stack_size);
#endif
    cuda_sim_switch(&fiber->sp, w->scheduler_sp);
    __builtin_unreachable();
}

void block_barrier() { worker->yield(FiberState::at_block_barrier, 0); }
void warp_barrier(unsigned int mask) { worker->yield(FiberState::at_warp_barrier, mask); }

int register_dynamic_shared(void* (*address)(), unsigned long long capacity) {
    dynamic_shared_regions().push_back({address, capacity});
    return 0;
}

namespace {
std::mutex error_mutex;
std::string last_error;

void set_error(const std::string& message) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (last_error.empty()) last_error = message;
}
}  // namespace

int run_grid(const LaunchConfig& c, BlockBody body, void* context) {
    {
        std::lock_guard<std::mutex> lock(error_mutex);
        last_error.clear();
    }
    unsigned long long threads = 1ull * c.block[0] * c.block[1] * c.block[2];
    if (threads == 0 || c.grid[0] * 1ull * c.grid[1] * c.grid[2] == 0) { set_error("empty grid or block"); return 1; }
    if (threads > 1024 || c.block[2] > 64) { set_error("block of " + std::to_string(threads) + " threads: CUDA allows at most 1024 (and blockDim.z <= 64)"); return 1; }
    if (c.grid[1] > 65535 || c.grid[2] > 65535) { set_error("gridDim.y and gridDim.z must be at most 65535"); return 1; }
    if (c.shared_bytes > CUDA_SIM_MAX_DYNAMIC_SHARED) { set_error("dynamic shared memory of " + std::to_string(c.shared_bytes) + " bytes exceeds 232448 (227 KiB)"); return 1; }

    unsigned long long blocks = 1ull * c.grid[0] * c.grid[1] * c.grid[2];
    std::vector<unsigned long long> order(blocks);
    for (unsigned long long i = 0; i < blocks; ++i) order[i] = i;
    if (c.seed) std::shuffle(order.begin(), order.end(), std::mt19937_64(c.seed));
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> failed{false};

    auto work = [&](unsigned int host_thread) {
        Worker w;
        w.config = &c; w.body = body; w.context = context;
        w.rng.seed(c.seed * 0x9E3779B97F4A7C15ull + host_thread);
        worker = &w;
        w.tls = module_tls();
        if (!w.tls.base) { set_error("cannot find the module's thread-local storage"); failed = true; }
        if (!failed && !w.prepare(static_cast<unsigned int>(threads))) { set_error(w.error); failed = true; }
        while (!failed) {
            unsigned long long i = next++;
            if (i >= blocks) break;
            unsigned long long b = order[i];
            uint3 block_idx = {static_cast<unsigned int>(b % c.grid[0]),
                               static_cast<unsigned int>((b / c.grid[0]) % c.grid[1]),
                               static_cast<unsigned int>(b / (1ull * c.grid[0] * c.grid[1]))};
            w.run_block(block_idx);
            if (!w.error.empty()) {
                set_error(w.error + " (block " + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) + "," + std::to_string(block_idx.z) + ")");
                failed = true;
            }
        }
        worker = nullptr;
    };
    unsigned int host_threads = static_cast<unsigned int>(std::min<unsigned long long>(std::max(1u, c.host_threads), blocks));
    if (host_threads == 1) {
        work(0);
    } else {
        std::vector<std::thread> pool;
        for (unsigned int t = 0; t < host_threads; ++t) pool.emplace_back(work, t);
        for (std::thread& t : pool) t.join();
    }
    return failed ? 1 : 0;
}

}  // namespace cuda_sim

extern "C" __attribute__((visibility("default"))) const char* cuda_sim_last_error() {
    std::lock_guard<std::mutex> lock(cuda_sim::error_mutex);
    return cuda_sim::last_error.c_str();
}
