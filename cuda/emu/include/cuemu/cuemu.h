// cuemu.h -- run CUDA C kernels on the CPU (lmkv's test harness for cuda/*.cu).
// Each CUDA thread of a block is a fiber; blocks run one after another, so __shared__ can be
// a function-local static.  __syncthreads / warp shuffles are real barriers between fibers,
// a seeded scheduler (CUEMU_SEED) shakes out missing barriers, and TSan/ASan builds see the
// fibers as threads.  Adopted from the shared cuemu prototype (tools/cuemu).
#pragma once
#ifndef CUEMU
#define CUEMU 1
#endif
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
// One block runs at a time, so a block's shared memory can be a function-local static.
#define __shared__ static
// Dynamic shared memory: kernels write  DYN_SMEM(char, smem);  (see kernel sources).
#define DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(::cuemu::dyn_smem())

// ---------------------------------------------------------------- vector types
struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim, gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------- runtime (fibers, default)
// Each CUDA thread of a block is a ucontext fiber on ONE OS thread; a fiber runs until it reaches
// a barrier (__syncthreads, shuffle, vote) or exits, then the scheduler resumes the next runnable
// one.  Deadlocks are detected exactly (nobody runnable, somebody waiting).  Under
// -fsanitize=thread every fiber is a TSan "thread" switched with no_sync, and barriers are
// release/acquire pairs, so a missing __syncthreads is reported as a data race.
#include <ucontext.h>
#ifdef __SANITIZE_THREAD__
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#define CUEMU_TSAN(...) __VA_ARGS__
#else
#define CUEMU_TSAN(...)
#endif
#include <random>

namespace cuemu {
using relaxed_int = std::atomic<int>;  // scheduler state: atomics so TSan neither reports nor syncs them
constexpr auto RLX = std::memory_order_relaxed;

struct Group {                       // a barrier: block (index 0) or one warp (1 + w)
  relaxed_int expected{0}, arrived{0}, gen{0};
  char sync_addr[2] = {0, 0};        // TSan release/acquire addresses, alternating by generation
};
constexpr size_t kStack = 256 * 1024;  // per fiber, aligned to its size: FiberRec* sits at its base
struct FiberRec {
  ucontext_t uc;
  char* stack = nullptr;
  uint3 tidx;
  unsigned tid = 0, xseq = 0;
  std::atomic<int> state{0};         // 0 runnable, 1 waiting, 2 exited
  std::atomic<int> wait_group{-1}, wait_gen{0};
  void* tsan = nullptr;
  const char* what = "";
};
struct Slot { unsigned char data[16]; unsigned seq; };
struct BlockCtx {
  unsigned nthreads = 0, nwarps = 0;
  std::vector<Group> groups;                               // 0: block, 1+w: warp w
  std::vector<Slot> xch[2];
  std::vector<std::atomic<unsigned char>> alive;
  std::vector<unsigned char> dyn_smem;
  std::vector<FiberRec> fibers;
  ucontext_t main_uc;
  void* main_tsan = nullptr;
  void (*thunk)(void**) = nullptr;
  void** args = nullptr;
};

inline thread_local BlockCtx* tl_ctx = nullptr;
inline char launch_token = 0;  // TSan: released by the launcher before a block, acquired by its fibers
inline FiberRec* self() {
  return *reinterpret_cast<FiberRec**>(reinterpret_cast<uintptr_t>(__builtin_frame_address(0)) & ~(uintptr_t)(kStack - 1));
}
inline unsigned cur_tid() { return self()->tid; }
inline unsigned next_xseq() { return self()->xseq++; }
#define threadIdx (::cuemu::self()->tidx)
inline void* dyn_smem() { return tl_ctx->dyn_smem.data(); }
inline unsigned lane_id() { return cur_tid() & 31u; }
inline unsigned warp_id() { return cur_tid() >> 5; }

inline void switch_to_main() {
  FiberRec& f = *self();
  CUEMU_TSAN(__tsan_switch_to_fiber(tl_ctx->main_tsan, 1 /*no_sync*/);)
  swapcontext(&f.uc, &tl_ctx->main_uc);
}

inline void group_wait(int gi, const char* what) {
  Group& g = tl_ctx->groups[gi];
  int gen = g.gen.load(RLX);
  CUEMU_TSAN(__tsan_release(&g.sync_addr[gen & 1]);)
  if (g.arrived.fetch_add(1, RLX) + 1 >= g.expected.load(RLX)) {  // last one: release everybody
    g.arrived.store(0, RLX);
    g.gen.store(gen + 1, RLX);
  } else {
    FiberRec& f = *self();
    f.what = what;
    f.wait_group.store(gi, RLX);
    f.wait_gen.store(gen, RLX);
    f.state.store(1, RLX);
    switch_to_main();  // resumed once g.gen != gen
  }
  CUEMU_TSAN(__tsan_acquire(&g.sync_addr[gen & 1]);)
}
inline void group_drop(int gi) {
  Group& g = tl_ctx->groups[gi];
  int e = g.expected.fetch_sub(1, RLX) - 1, a = g.arrived.load(RLX);
  if (a > 0 && a >= e) { g.arrived.store(0, RLX); g.gen.fetch_add(1, RLX); }
}
inline void syncthreads() { group_wait(0, "__syncthreads"); }
inline void warp_wait(const char* what) { group_wait(1 + (int)warp_id(), what); }
inline void syncwarp() { warp_wait("__syncwarp"); }

inline void fiber_entry() {
  CUEMU_TSAN(__tsan_acquire(&launch_token);)  // sees the launcher's set-up, not earlier fibers
  tl_ctx->thunk(tl_ctx->args);  // the kernel body
  unsigned t = cur_tid();
  tl_ctx->alive[t].store(0, RLX);
  group_drop(1 + (int)(t >> 5));
  group_drop(0);
  tl_ctx->fibers[t].state.store(2, RLX);
  FiberRec& f = tl_ctx->fibers[t];
  CUEMU_TSAN(__tsan_switch_to_fiber(tl_ctx->main_tsan, 0 /*sync: the launcher sees everything*/);)
  swapcontext(&f.uc, &tl_ctx->main_uc);
}

[[noreturn]] inline void fail(const char* fmt, const char* what) {
  std::fprintf(stderr, "cuemu: ");
  std::fprintf(stderr, fmt, what);
  std::fprintf(stderr, " (block %u,%u,%u thread %u,%u,%u)\n", blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x, threadIdx.y, threadIdx.z);
  std::fflush(stderr);
  std::abort();
}
}  // namespace cuemu

namespace cuemu {
// Every live lane of the warp publishes v, then reads lane src(lane) (or keeps its own value
// when src(lane) < 0).  One barrier per exchange thanks to double buffering.
template <class T, class SrcFn>
inline T exchange(T v, SrcFn src_of, const char* what) {
  static_assert(sizeof(T) <= 16 && std::is_trivially_copyable_v<T>, "shuffle type too large");
  const unsigned seq = next_xseq();  // per-thread count of warp exchanges; buffer = seq & 1
  auto& buf = tl_ctx->xch[seq & 1u];
  std::memcpy(buf[cur_tid()].data, &v, sizeof(T));
  buf[cur_tid()].seq = seq;
  warp_wait(what);
  int s = src_of((int)lane_id());
  if (s < 0) return v;
  unsigned src = (warp_id() << 5) + (unsigned)s;
  if (src >= tl_ctx->nthreads || buf[src].seq != seq)
    fail("%s reads a lane that did not take part in this exchange (missing / exited / divergent)", what);
  T r;
  std::memcpy(&r, buf[src].data, sizeof(T));
  return r;
}

inline void check_mask(unsigned mask, const char* what) {
  // the emulator needs every live lane of the warp to take part
  unsigned need = 0;
  for (unsigned l = 0; l < 32; ++l) {
    unsigned t = (warp_id() << 5) + l;
    if (t < tl_ctx->nthreads && tl_ctx->alive[t]) need |= 1u << l;
  }
  if ((mask & need) != need) fail("%s with a partial mask is not supported by the emulator", what);
}

}  // namespace cuemu

inline void __syncthreads() { cuemu::syncthreads(); }
inline int __syncthreads_or(int p) { // block-wide OR via shared flag
  static std::atomic<int> acc{0};
  cuemu::syncthreads(); if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) acc = 0;
  cuemu::syncthreads(); if (p) acc = 1; cuemu::syncthreads(); int r = acc; cuemu::syncthreads(); return r;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu::check_mask(mask, "__syncwarp"); cuemu::syncwarp(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lm, int width = 32) {
  cuemu::check_mask(mask, "__shfl_xor_sync");
  return cuemu::exchange(v, [&](int lane) { int s = lane ^ lm; return s >= (lane / width + 1) * width ? -1 : s; },
                         "__shfl_xor_sync");
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  cuemu::check_mask(mask, "__shfl_sync");
  return cuemu::exchange(v, [&](int lane) { return (lane / width) * width + (src % width); }, "__shfl_sync");
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  cuemu::check_mask(mask, "__shfl_down_sync");
  return cuemu::exchange(v, [&](int lane) { int s = lane + (int)d; return (s % 32) / width != (lane % 32) / width || s >= 32 ? -1 : s; },
                         "__shfl_down_sync");
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  cuemu::check_mask(mask, "__shfl_up_sync");
  return cuemu::exchange(v, [&](int lane) { int s = lane - (int)d; return s < (lane / width) * width ? -1 : s; },
                         "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  cuemu::check_mask(mask, "__ballot_sync");
  auto* ctx = cuemu::tl_ctx;
  const unsigned seq = cuemu::next_xseq();
  auto& buf = ctx->xch[seq & 1u];
  buf[cuemu::cur_tid()].data[0] = p ? 1 : 0;
  buf[cuemu::cur_tid()].seq = seq;
  cuemu::warp_wait("__ballot_sync");
  unsigned r = 0, base = cuemu::warp_id() << 5;
  for (unsigned l = 0; l < 32 && base + l < ctx->nthreads; ++l)
    if (buf[base + l].seq == seq && buf[base + l].data[0]) r |= 1u << l;
  return r & mask;
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return __ballot_sync(m, p) == (m & __ballot_sync(m, 1)); }
inline unsigned __activemask() { return __ballot_sync(0xffffffffu, 1); }

// ---------------------------------------------------------------- atomics
template <class T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> inline T atomicSub(T* p, T v) { return std::atomic_ref<T>(*p).fetch_sub(v); }
template <class T> inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v); return cmp; }
template <class T> inline T atomicMax(T* p, T v) { std::atomic_ref<T> a(*p); T o = a.load(); while (o < v && !a.compare_exchange_weak(o, v)) {} return o; }
template <class T> inline T atomicMin(T* p, T v) { std::atomic_ref<T> a(*p); T o = a.load(); while (o > v && !a.compare_exchange_weak(o, v)) {} return o; }

// ---------------------------------------------------------------- math / intrinsics
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float exp2f(float x) { return std::exp2(x); }
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
// CUDA's global min/max overloads
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
[[noreturn]] inline void __trap() { cuemu::fail("%s", "__trap()"); }

// ---------------------------------------------------------------- launcher + export table
namespace cuemu {
struct KernelInfo {
  void (*thunk)(void** args);
  int nargs;
  const int* sizes;  // sizeof each parameter
  const char* kinds; // 'p' pointer, 'i' signed int, 'u' unsigned int, 'f' float, 'b' bool, 'o' other
};

template <class A> constexpr char kind_of() {
  using T = std::remove_cv_t<A>;
  if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, bool>) return 'b';
  else if constexpr (std::is_floating_point_v<T>) return 'f';
  else if constexpr (std::is_integral_v<T>) return std::is_signed_v<T> ? 'i' : 'u';
  else return 'o';
}

template <class... A, size_t... I>
inline void call_impl(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*reinterpret_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A> struct Sig {
  static constexpr int n = sizeof...(A);
  static constexpr int sizes[n + 1] = {(int)sizeof(A)..., 0};
  static constexpr char kinds[n + 1] = {kind_of<A>()..., 0};
};
template <class F> struct SigOf;
template <class... A> struct SigOf<void (*)(A...)> {
  using S = Sig<A...>;
  template <auto K> static void thunk(void** args) { call_impl(K, args, std::index_sequence_for<A...>{}); }
};

template <auto K> const KernelInfo* make_info() {
  using SO = SigOf<decltype(K)>;
  static const KernelInfo info{&SO::template thunk<K>, SO::S::n, SO::S::sizes, SO::S::kinds};
  return &info;
}

inline std::mutex& launch_mutex() { static std::mutex m; return m; }

inline int launch(const KernelInfo* k, const unsigned* g, const unsigned* b, size_t smem, void** args) {
  std::lock_guard<std::mutex> lg(launch_mutex());  // one launch at a time (statics = shared mem)
  const dim3 grid(g[0], g[1], g[2]), block(b[0], b[1], b[2]);
  const unsigned nt = block.x * block.y * block.z;
  if (nt == 0 || nt > 1024) { std::fprintf(stderr, "cuemu: bad block size %u\n", nt); return 1; }
  static const char* seed_env = std::getenv("CUEMU_SEED");  // randomise fiber order (race shaking)
  std::mt19937 rng(seed_env ? (unsigned)std::atoi(seed_env) : 0u);
  BlockCtx ctx;
  ctx.nthreads = nt;
  ctx.nwarps = (nt + 31) / 32;
  ctx.groups = std::vector<Group>(1 + ctx.nwarps);
  ctx.xch[0].resize(nt);
  ctx.xch[1].resize(nt);
  ctx.alive = std::vector<std::atomic<unsigned char>>(nt);
  ctx.fibers = std::vector<FiberRec>(nt);
  ctx.thunk = k->thunk;
  ctx.args = args;
  for (auto& f : ctx.fibers) {
    f.stack = static_cast<char*>(std::aligned_alloc(kStack, kStack));
    *reinterpret_cast<FiberRec**>(f.stack) = &f;
  }
  CUEMU_TSAN(ctx.main_tsan = __tsan_get_current_fiber();)
  CUEMU_TSAN(for (auto& f : ctx.fibers) f.tsan = __tsan_create_fiber(0);)
  tl_ctx = &ctx;
  std::vector<unsigned> order(nt);
  for (unsigned t = 0; t < nt; ++t) order[t] = t;
  int rc = 0;
  for (unsigned bz = 0; bz < grid.z && !rc; ++bz)
    for (unsigned by = 0; by < grid.y && !rc; ++by)
      for (unsigned bx = 0; bx < grid.x && !rc; ++bx) {
        ctx.groups[0].expected.store((int)nt, RLX);
        ctx.groups[0].arrived.store(0, RLX);
        for (unsigned w = 0; w < ctx.nwarps; ++w) {
          ctx.groups[1 + w].expected.store((int)std::min(32u, nt - 32 * w), RLX);
          ctx.groups[1 + w].arrived.store(0, RLX);
        }
        ctx.dyn_smem.assign(smem + 16, 0xCD);  // garbage-fill: uninitialised shared reads show up
        for (auto& xb : ctx.xch) for (auto& sl : xb) sl.seq = ~0u;
        for (unsigned t = 0; t < nt; ++t) {
          FiberRec& f = ctx.fibers[t];
          ctx.alive[t].store(1, RLX);
          f.state.store(0, RLX);
          f.tid = t;
          f.tidx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
          f.xseq = 0;
          getcontext(&f.uc);
          f.uc.uc_stack.ss_sp = f.stack + 256;  // [0,256): FiberRec* + guard
          f.uc.uc_stack.ss_size = kStack - 256;
          f.uc.uc_link = nullptr;
          makecontext(&f.uc, (void (*)())fiber_entry, 0);
        }
        blockIdx = uint3{bx, by, bz};  // written once per block, before the fibers start (synced)
        blockDim = block;
        gridDim = grid;
        CUEMU_TSAN(__tsan_release(&launch_token);)
        if (seed_env) {  // random warp priorities + random lane order inside each warp
          std::vector<unsigned> wp(ctx.nwarps);
          for (unsigned w = 0; w < ctx.nwarps; ++w) wp[w] = w;
          std::shuffle(wp.begin(), wp.end(), rng);
          order.clear();
          for (unsigned w : wp) {
            size_t first = order.size();
            for (unsigned t = 32 * w; t < std::min(nt, 32 * w + 32); ++t) order.push_back(t);
            std::shuffle(order.begin() + first, order.end(), rng);
          }
        }
        // Priority scheduling: always resume the first runnable fiber in `order`, so a
        // high-priority warp runs ahead as far as the barriers allow (good at exposing
        // missing __syncthreads).
        unsigned left = nt;
        while (left) {
          FiberRec* pick = nullptr;
          for (unsigned t : order) {
            FiberRec& f = ctx.fibers[t];
            int st = f.state.load(RLX);
            if (st == 1 && ctx.groups[f.wait_group.load(RLX)].gen.load(RLX) != f.wait_gen.load(RLX))
              f.state.store(st = 0, RLX);  // its barrier has opened
            if (st == 0) { pick = &f; break; }
          }
          if (!pick) {  // everybody left is waiting on a barrier that cannot open
            for (unsigned t = 0; t < nt; ++t) {
              FiberRec& f = ctx.fibers[t];
              if (f.state.load(RLX) != 1) continue;
              Group& gr = ctx.groups[f.wait_group.load(RLX)];
              std::fprintf(stderr, "cuemu: deadlock in block (%u,%u,%u): thread %u waits in %s "
                           "(%d of %d live threads arrived)\n", bx, by, bz, t, f.what,
                           gr.arrived.load(RLX), gr.expected.load(RLX));
              break;
            }
            rc = 2;
            break;
          }
          // no_sync: fibers synchronise only through barriers and launch_token. (A synchronising
          // switch would order a fiber after every fiber that exited before it started, hiding
          // races such as a missing __syncthreads before thread 0 reads what others write.)
          CUEMU_TSAN(__tsan_switch_to_fiber(pick->tsan, 1 /*no_sync*/);)  // then only swapcontext
          swapcontext(&ctx.main_uc, &pick->uc);
          if (pick->state.load(RLX) == 2) --left;
        }
      }
  CUEMU_TSAN(for (auto& f : ctx.fibers) __tsan_destroy_fiber(f.tsan);)
  for (auto& f : ctx.fibers) std::free(f.stack);
  tl_ctx = nullptr;
  return rc;
}
}  // namespace cuemu

// Exported with C linkage by the generated wrapper:  CUEMU_EXPORT(0, my_kernel)
#define CUEMU_EXPORT(idx, ...) \
  extern "C" const ::cuemu::KernelInfo* cuemu_info_##idx() { return ::cuemu::make_info<&__VA_ARGS__>(); }
#define CUEMU_DEFINE_LAUNCH \
  extern "C" int cuemu_launch(const ::cuemu::KernelInfo* k, const unsigned* g, const unsigned* b, \
                              unsigned long smem, void** args) { return ::cuemu::launch(k, g, b, smem, args); }

#include "cuemu/half.h"
