// Work split between the calling thread and one helper thread that runs only on idle CPU time.
//
// An engine on a small machine computes on one thread and leaves the other core to tritonserver,
// the stubs and the client (docs/engines.md, "CPU threads"): a second OpenMP thread would stall
// every parallel region whenever another process took its core. The helper here is scheduled
// SCHED_IDLE, so it runs only when a core would otherwise idle, and it can never hold the caller
// up: a call's work is cut into chunks, the caller taking them from the first up and the helper
// from the last down (each computes a run of neighbours); the caller writes its chunks in place,
// the helper computes into scratch and copies a chunk out only if the caller has not taken it
// back meanwhile. When the caller runs out of chunks it takes back every chunk
// the helper has not finished (and computes it itself), waiting only for a copy in progress. Every
// chunk is computed by the same code whoever runs it, so results do not depend on the split.
//
// A heavy job (Job::heavy: a prompt's projections, more than 128 rows) the helper computes at
// normal priority, and returns to SCHED_IDLE after it. Under a client that busy-polls the other
// core (aiperf's plain mode), SCHED_IDLE left the helper a tenth of the chunks and the engine
// thread every prompt alone; at normal priority it takes a fair share of that core while the
// prompt lasts, and never while it spins between jobs (which cost the engine thread when the
// helper always ran at normal priority). LLM_HELPER_BOOST=0 keeps it SCHED_IDLE throughout, and
// where leaving SCHED_IDLE is refused (it needs CAP_SYS_NICE or RLIMIT_NICE room) it stays so.
//
// The helper spins briefly after a job (the next projection of a step follows within
// microseconds) and then sleeps on a futex, so an idle engine costs no CPU. After a fork the
// child starts its own helper. Without Linux, or with the helper switched off, the caller
// computes every chunk.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

namespace llm {

// Chunk c of a job writes `rows` rows of `row_bytes` bytes each at `dst`, `ld` bytes apart.
struct Block {
  char* dst;
  int64_t ld;
  int64_t rows;
  int64_t row_bytes;
};

struct Job {
  int64_t chunks = 0;
  std::function<Block(int64_t)> place;                     // where chunk c's result goes
  std::function<void(int64_t, char*, int64_t)> compute;  // chunk c into (dst, ld in bytes)
  std::vector<at::Tensor> keep;  // inputs and output, alive while the helper may read them
  // Long enough to take a share of a busy core for (a call of more than 128 rows, a prompt's,
  // on every path): the helper computes it at normal priority (see boost in idle_helper.cpp).
  bool heavy = false;
};

// Runs `job` on the calling thread and the helper; returns when every chunk is in place.
void run(Job job);

// Whether the calling thread is the helper (it takes a job's chunks from the last one down).
bool on_helper();

// Whether calls may use the helper (default: yes, with more than one CPU). Returns the old value.
bool set_helper_enabled(bool enabled);

// Since the process started: chunks of every job, those the helper computed and kept, those
// the caller took back from it, and the heavy jobs the helper worked on at normal priority.
struct HelperStats {
  int64_t chunks;
  int64_t helped;
  int64_t taken_back;
  int64_t boosted;
};
HelperStats helper_stats();

}  // namespace llm
