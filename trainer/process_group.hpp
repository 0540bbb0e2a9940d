// The trainer ranks of one job and their collectives: PyTorch's own c10d process groups (Gloo
// on CPU, NCCL on CUDA) over a TCPStore, driven from C++. Nothing here implements a collective;
// c10d headers stay in process_group.cpp so that including this costs no more than ATen.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace troupe {

// Where this process sits among the trainer ranks. Read from the environment that a launcher
// sets: troupe's own (parallel.trainer_ranks), torchrun, Slurm's srun or OpenMPI's mpirun.
struct ParallelEnv {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;  // on this machine
  std::string master_addr = "127.0.0.1";     // where rank 0's store listens (MASTER_ADDR)
  int master_port = 29500;                   // MASTER_PORT
  // torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 too, connects as a client.
  bool agent_store = false;
  std::string launcher = "none";  // troupe, torchrun, slurm, openmpi or none (one process)

  bool distributed() const { return world_size > 1; }
};

// The variables of the first launcher found: torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; troupe's launcher sets the same ones), then
// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE), then OpenMPI's
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE); Slurm and OpenMPI take MASTER_ADDR
// and MASTER_PORT from the environment too. `get` reads one variable (std::getenv in a run;
// a map in tests). Throws Error naming the variable that is malformed or inconsistent.
ParallelEnv parallel_env(const std::function<const char*(const char*)>& get);
ParallelEnv parallel_env();  // from this process's environment

// One c10d process group: every rank calls each collective in the same order. Each call
// waits for its result; one that waits longer than the group's timeout (a dead or hung rank)
// throws Error naming the operation, this rank and the timeout. SUM reductions only: the
// trainer divides by global counts itself, so results match one rank on the whole batch.
class ProcessGroup {
 public:
  // Rendezvous through a TCPStore at env.master_addr:master_port (rank 0 serves it, unless the
  // launcher's agent does), then a Gloo group (CPU tensors) or an NCCL group (device CUDA,
  // where troupe was built with CUDA). Each group has its own PrefixStore (`name`).
  static std::shared_ptr<ProcessGroup> connect(const ParallelEnv& env, c10::Device device,
                                               std::chrono::milliseconds timeout, const std::string& name = "trainer");
  ~ProcessGroup();

  int rank() const;
  int size() const;
  std::string backend() const;  // "gloo" or "nccl"
  std::chrono::milliseconds timeout() const;  // how long a collective may wait

  void all_reduce_sum(at::Tensor& t);
  // out (n) = the sum over ranks of this rank's slice of `in` (size() x n, contiguous).
  void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in);
  // out (size() x n) = every rank's `in` (n), in rank order.
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // The same, started: `out` holds the result once the returned function has returned (it
  // throws as the collectives above do). Meanwhile this rank may compute, or start others.
  std::function<void()> start_all_gather(at::Tensor& out, const at::Tensor& in);
  void broadcast(at::Tensor& t, int root);
  void barrier();

  // The sum (max) over ranks of a few numbers (token counts, loss sums), in float64.
  double sum(double local);
  double max(double local);

  struct Impl;

 private:
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe
