// See idle_helper.h.
#include "idle_helper.h"

#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLM_HAVE_HELPER 1
#else
#define LLM_HAVE_HELPER 0
#endif

namespace llm {
namespace {

// A chunk's life. The caller claims chunks from the front (FREE -> MINE -> DONE), the helper from
// the back (FREE -> CLAIMED -> WRITING -> DONE), each until it meets the other's, so both compute
// runs of neighbouring chunks (linear.cpp prepares a chunk's neighbour during it). The caller
// moves a helper's chunk from FREE or CLAIMED to TAKEN when it takes it back.
enum State : uint8_t { FREE, MINE, CLAIMED, WRITING, DONE, TAKEN };

std::atomic<bool> g_enabled{true};
thread_local bool t_on_helper = false;
std::atomic<int64_t> g_chunks{0};
std::atomic<int64_t> g_helped{0};
std::atomic<int64_t> g_taken_back{0};
std::atomic<int64_t> g_boosted{0};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A job as the helper sees it. Slots are reused, never freed while the process lives: the helper
// pins one (`users`) before reading it, and the caller refills only slots nobody pins.
struct Slot {
  Job job;
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  int64_t capacity = 0;
  std::atomic<int64_t> next{0};   // the caller takes chunks from the front,
  std::atomic<int64_t> back{-1};  // the helper from the back: each a run of neighbours
  std::atomic<int> users{0};

  void reset(Job&& j) {
    job = std::move(j);
    if (capacity < job.chunks) {
      capacity = std::max<int64_t>(job.chunks, 2 * capacity);
      state.reset(new std::atomic<uint8_t>[capacity]);
    }
    for (int64_t i = 0; i < job.chunks; ++i) state[i].store(FREE, std::memory_order_relaxed);
    next.store(0, std::memory_order_relaxed);
    back.store(job.chunks - 1, std::memory_order_relaxed);
  }
};

void compute_in_place(const Job& job, int64_t c) {
  const Block b = job.place(c);
  job.compute(c, b.dst, b.ld);
}

#if LLM_HAVE_HELPER

constexpr auto kSpin = std::chrono::milliseconds(2);  // then sleep until the next job

// This process's id, kept current across fork() by an atfork handler: asking the kernel
// (getpid is a system call) on every job took 1% of a decode step's engine thread.
pid_t current_pid() {
  static std::atomic<pid_t> pid = [] {
    pthread_atfork(nullptr, nullptr, [] { pid.store(getpid()); });
    return getpid();
  }();
  return pid.load(std::memory_order_relaxed);
}

class Helper {
 public:
  Helper() : pid_(current_pid()) {}

  // The helper of this process, started on first use; nullptr where there is none.
  static Helper* get() {
    static std::atomic<Helper*> instance{nullptr};
    Helper* h = instance.load(std::memory_order_acquire);
    if (h != nullptr && h->pid_ == current_pid()) return h->running_ ? h : nullptr;
    // First use, or a forked child (which has the parent's object but not its thread); the old
    // object is left as it is, since the parent's thread may still read it.
    static std::mutex start;
    std::lock_guard<std::mutex> lock(start);
    h = instance.load(std::memory_order_acquire);
    if (h == nullptr || h->pid_ != current_pid()) {
      h = new Helper();
      h->start();
      instance.store(h, std::memory_order_release);
    }
    return h->running_ ? h : nullptr;
  }

  // Held by the one caller that may use the helper at a time (an engine's loop thread; others
  // compute alone). It guards the slots.
  std::mutex caller;

  Slot* publish(Job&& job) {
    Slot* slot = nullptr;
    for (auto& s : slots_) {
      if (s->users.load() == 0) {
        slot = s.get();
        break;
      }
    }
    if (slot == nullptr) {
      slots_.push_back(std::make_unique<Slot>());
      slot = slots_.back().get();
    }
    slot->reset(std::move(job));
    current_.store(slot);
    gen_.fetch_add(1);
    if (sleeping_.load()) futex(FUTEX_WAKE_PRIVATE, 1);
    return slot;
  }

  void retract() { current_.store(nullptr); }

 private:
  void start() {
    try {
      std::thread([this] { loop(); }).detach();
      running_ = true;
    } catch (const std::system_error&) {
      running_ = false;  // no thread to be had: the caller computes everything
    }
  }

  long futex(int op, uint32_t value) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), op, value, nullptr, nullptr, 0);
  }

  void loop() {
    pthread_setname_np(pthread_self(), "llm-idle-helper");
    t_on_helper = true;
    sched_param param{};
    if (sched_setscheduler(0, SCHED_IDLE, &param) != 0) {
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
    }
    std::vector<float> scratch;
    uint32_t seen = gen_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (uint32_t i = 0; gen_.load(std::memory_order_acquire) == seen; ++i) {
        if ((i & 1023) != 1023) {
          cpu_relax();
        } else if (std::chrono::steady_clock::now() > until) {
          sleeping_.store(true);
          if (gen_.load() == seen) futex(FUTEX_WAIT_PRIVATE, seen);
          sleeping_.store(false);
        }
      }
      seen = gen_.load();
      Slot* slot = current_.load();
      if (slot == nullptr) continue;
      slot->users.fetch_add(1);
      if (current_.load() == slot) {
        const bool boosted = slot->job.heavy && boost(true);
        work(*slot, scratch);
        if (boosted) {
          boost(false);
          g_boosted.fetch_add(1, std::memory_order_relaxed);
        }
      }
      slot->users.fetch_sub(1);
    }
  }

  // Normal priority for a heavy job, SCHED_IDLE again after it (not while spinning between
  // jobs). False where the switch is refused (leaving SCHED_IDLE needs RLIMIT_NICE room or
  // CAP_SYS_NICE) or switched off (LLM_HELPER_BOOST=0), from then on.
  static bool boost(bool on) {
    static std::atomic<bool> allowed{[] {
      const char* env = std::getenv("LLM_HELPER_BOOST");
      return env == nullptr || std::strcmp(env, "0") != 0;
    }()};
    if (!allowed.load(std::memory_order_relaxed)) return false;
    sched_param param{};
    if (sched_setscheduler(0, on ? SCHED_OTHER : SCHED_IDLE, &param) != 0) {
      allowed.store(false);
      return false;
    }
    return true;
  }

  static void work(Slot& slot, std::vector<float>& scratch) {  // float: aligned for any dtype
    const Job& job = slot.job;
    for (;;) {
      const int64_t c = slot.back.fetch_sub(1);
      if (c < 0) return;
      uint8_t expected = FREE;
      if (!slot.state[c].compare_exchange_strong(expected, CLAIMED)) return;  // the caller's
      const Block b = job.place(c);
      scratch.resize(static_cast<size_t>((b.rows * b.row_bytes + 3) / 4));
      char* mine = reinterpret_cast<char*>(scratch.data());
      job.compute(c, mine, b.row_bytes);
      expected = CLAIMED;
      if (!slot.state[c].compare_exchange_strong(expected, WRITING)) continue;  // taken back
      for (int64_t r = 0; r < b.rows; ++r) {
        std::memcpy(b.dst + r * b.ld, mine + r * b.row_bytes, b.row_bytes);
      }
      slot.state[c].store(DONE, std::memory_order_release);
      g_helped.fetch_add(1, std::memory_order_relaxed);
    }
  }

  const pid_t pid_;
  bool running_ = false;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::atomic<Slot*> current_{nullptr};
  std::atomic<uint32_t> gen_{0};
  std::atomic<bool> sleeping_{false};
};

bool cpus_to_spare() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return false;
  return CPU_COUNT(&set) > 1;
}

#endif  // LLM_HAVE_HELPER

}  // namespace

void run(Job job) {
  g_chunks.fetch_add(job.chunks, std::memory_order_relaxed);
#if LLM_HAVE_HELPER
  static const bool spare = cpus_to_spare();
  Helper* helper = (job.chunks > 1 && spare && g_enabled.load(std::memory_order_relaxed))
                       ? Helper::get() : nullptr;
  std::unique_lock<std::mutex> lock;
  if (helper != nullptr) lock = std::unique_lock<std::mutex>(helper->caller, std::try_to_lock);
  if (lock.owns_lock()) {
    Slot& slot = *helper->publish(std::move(job));
    const Job& j = slot.job;
    for (;;) {
      const int64_t c = slot.next.fetch_add(1);
      if (c >= j.chunks) break;
      uint8_t expected = FREE;
      if (!slot.state[c].compare_exchange_strong(expected, MINE)) break;  // the helper's from here
      compute_in_place(j, c);
      slot.state[c].store(DONE, std::memory_order_relaxed);
    }
    int64_t taken = 0;
    for (int64_t c = 0; c < j.chunks; ++c) {
      uint8_t s = slot.state[c].load(std::memory_order_acquire);
      while (s != DONE && s != TAKEN) {
        if (s == WRITING) {
          cpu_relax();
          s = slot.state[c].load(std::memory_order_acquire);
        } else if (slot.state[c].compare_exchange_weak(s, TAKEN, std::memory_order_acq_rel)) {
          compute_in_place(j, c);
          ++taken;
          break;
        }
      }
    }
    helper->retract();
    // Let go of the job's tensors now unless the helper still holds the slot (a chunk taken back
    // from it); a helper that pins it from here on finds it retracted and leaves it alone.
    if (slot.users.load() == 0) slot.job = Job{};
    if (taken > 0) g_taken_back.fetch_add(taken, std::memory_order_relaxed);
    return;
  }
#endif
  for (int64_t c = 0; c < job.chunks; ++c) compute_in_place(job, c);
}

bool set_helper_enabled(bool enabled) { return g_enabled.exchange(enabled); }

bool on_helper() { return t_on_helper; }

HelperStats helper_stats() {
  return {g_chunks.load(), g_helped.load(), g_taken_back.load(), g_boosted.load()};
}

}  // namespace llm

namespace {

bool set_idle_helper(bool enabled) { return llm::set_helper_enabled(enabled); }

std::vector<int64_t> idle_helper_stats() {
  const llm::HelperStats s = llm::helper_stats();
  return {s.chunks, s.helped, s.taken_back, s.boosted};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("set_idle_helper(bool enabled) -> bool", &set_idle_helper);
  m.def("idle_helper_stats() -> int[]", &idle_helper_stats);
}
