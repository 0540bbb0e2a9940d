// `troupe run CONFIG parallel.trainer_ranks=N`: starts N rank processes of this same binary on
// this machine, as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), splits the cores between them, and supervises them. Not a collective or a
// transport: the ranks find each other through c10d's TCPStore (trainer/process_group.hpp).
#pragma once

#include <string>
#include <vector>

namespace troupe {

struct LaunchOptions {
  int ranks = 2;
  int threads_per_rank = 0;  // 0: the machine's cores divided among the ranks (at least 1)
  double grace_s = 10;       // after a rank fails, the others get SIGTERM, then SIGKILL after this
};

// Runs `exe args...` as ranks 0..N-1 and waits for all of them. A first Ctrl-C or a SIGTERM is
// passed on to every rank (each then stops as `troupe run` does); a rank that exits non-zero or
// dies stops the others, and the error names it. Returns 0 when every rank succeeded, else 1.
int launch_ranks(const std::string& exe, const std::vector<std::string>& args, const LaunchOptions& options);

}  // namespace troupe
