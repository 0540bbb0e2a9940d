// c10d's Gloo (and, in CUDA builds, NCCL) backends called directly, over a TCPStore with one
// PrefixStore per group. The torch wheel carries no gloo/ headers; Debian's libgloo-dev
// declares the types that ProcessGroupGloo.hpp names, and gloo itself is the copy inside
// libtorch_cpu.so: troupe constructs no gloo object, it only passes c10d's devices along.
#include "trainer/process_group.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "policy/error.hpp"

namespace troupe {

#ifdef TROUPE_WITH_NCCL
namespace detail {  // process_group_nccl.cpp, built with CUDA
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);
}
#endif

namespace {

// An integer environment variable; throws Error naming it when it is set but not a number.
std::optional<int> env_int(const std::function<const char*(const char*)>& get, const char* name) {
  const char* v = get(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > 1 << 24)
    throw Error(std::string(name) + "='" + v + "': expected a non-negative integer");
  return static_cast<int>(n);
}

// The local address from which this machine reaches `peer` (no packet is sent: a UDP
// connect only picks the route), so that Gloo listens on the interface the others can reach
// rather than on whatever the hostname maps to (Debian maps it to 127.0.1.1).
std::string local_address_towards(const std::string& peer) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(peer.c_str(), "9", &hints, &found) != 0 || !found)
    throw Error("MASTER_ADDR '" + peer + "': cannot resolve this host name");
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  std::string out;
  if (fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof local;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf)) out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  if (out.empty()) throw Error("MASTER_ADDR '" + peer + "': no local interface routes to it");
  return out;
}

}  // namespace

ParallelEnv parallel_env(const std::function<const char*(const char*)>& get) {
  ParallelEnv e;
  auto text = [&](const char* name) -> std::string {
    const char* v = get(name);
    return v ? v : "";
  };
  struct Names {
    const char *launcher, *rank, *size, *local_rank, *local_size;
  };
  // torchrun's names first: troupe's own launcher sets them too, and an srun that starts
  // torchrun leaves SLURM_* set around processes that torchrun has already numbered.
  const Names launchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
  };
  for (const auto& n : launchers) {
    auto rank = env_int(get, n.rank);
    auto size = env_int(get, n.size);
    if (!rank && !size) continue;
    if (!rank || !size) throw Error(std::string(n.rank) + " and " + n.size + " must be set together (" + n.launcher + ")");
    if (*size < 1) throw Error(std::string(n.size) + "=" + std::to_string(*size) + ": expected at least 1");
    if (*rank >= *size)
      throw Error(std::string(n.rank) + "=" + std::to_string(*rank) + " is not below " + n.size + "=" + std::to_string(*size));
    e.launcher = n.launcher;
    e.rank = *rank;
    e.world_size = *size;
    // Slurm writes SLURM_NTASKS_PER_NODE as "2" or "2(x3)"; the leading count is this node's.
    std::string local_size = text(n.local_size);
    if (auto paren = local_size.find('('); paren != std::string::npos) local_size.resize(paren);
    e.local_rank = env_int(get, n.local_rank).value_or(0);
    e.local_world_size = local_size.empty() ? e.world_size : std::atoi(local_size.c_str());
    if (e.local_world_size < 1) e.local_world_size = 1;
    break;
  }
  if (text("TROUPE_LAUNCHER") == "troupe" && e.launcher == "torchrun") e.launcher = "troupe";
  if (!text("MASTER_ADDR").empty()) e.master_addr = text("MASTER_ADDR");
  if (auto port = env_int(get, "MASTER_PORT")) {
    if (*port < 1 || *port > 65535) throw Error("MASTER_PORT=" + std::to_string(*port) + ": expected a port in 1..65535");
    e.master_port = *port;
  }
  std::string agent = text("TORCHELASTIC_USE_AGENT_STORE");
  e.agent_store = agent == "True" || agent == "true" || agent == "1";
  if (e.distributed() && e.launcher != "torchrun" && e.launcher != "troupe" && text("MASTER_ADDR").empty())
    throw Error("MASTER_ADDR is not set: under " + e.launcher +
                " set it to the first node's address (the README's Slurm example shows how)");
  return e;
}

ParallelEnv parallel_env() {
  return parallel_env([](const char* name) { return std::getenv(name); });
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout{0};
  std::string name;

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) {
    try {
      work->wait(timeout);
    } catch (const std::exception& e) {
      throw Error("process group '" + name + "': " + op + " failed on rank " + std::to_string(backend->getRank()) +
                  " of " + std::to_string(backend->getSize()) + " (a rank died, hung past parallel.timeout_s = " +
                  std::to_string(timeout.count() / 1000) + " s, or disagrees on the step): " + e.what());
    }
  }
};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::connect(const ParallelEnv& env, c10::Device device,
                                                    std::chrono::milliseconds timeout, const std::string& name) {
  auto impl = std::make_unique<Impl>();
  impl->timeout = timeout;
  impl->name = name;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0 && !env.agent_store;
  store_options.numWorkers = env.world_size;
  store_options.waitWorkers = false;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(env.rank) + ": cannot " +
                (store_options.isServer ? "serve" : "reach") + " the rendezvous store at " + env.master_addr + ":" +
                std::to_string(env.master_port) + " (MASTER_ADDR, MASTER_PORT): " + e.what());
  }
  impl->store = c10::make_intrusive<c10d::PrefixStore>(name, tcp);
  if (device.is_cuda()) {
#ifdef TROUPE_WITH_NCCL
    try {
      impl->backend = detail::make_nccl_backend(impl->store, env.rank, env.world_size, timeout);
    } catch (const std::exception& e) {
      throw Error("rank " + std::to_string(env.rank) + ": the NCCL group did not form: " + e.what());
    }
    return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
#else
    throw Error("parallel: trainer ranks on " + device.str() +
                " need NCCL, and this troupe was built without CUDA; use model.device=cpu (Gloo)");
#endif
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME names an interface, as in PyTorch; otherwise the address that routes to
  // rank 0 (loopback for a job on one machine).
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local_address_towards(env.master_addr)));
  }
  options->threads = 1;  // one process per core share: collectives run on one thread
  try {
    impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, env.rank, env.world_size, options);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                ": the Gloo group did not form within parallel.timeout_s (is every rank started?): " + e.what());
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

int ProcessGroup::rank() const { return impl_->backend->getRank(); }
int ProcessGroup::size() const { return impl_->backend->getSize(); }
std::string ProcessGroup::backend() const { return impl_->backend->getBackendName(); }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->timeout; }

void ProcessGroup::all_reduce_sum(at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  impl_->wait(impl_->backend->allreduce(tensors, c10d::AllreduceOptions{}), "all_reduce");
}

void ProcessGroup::reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: input ", in.sizes(), " is not ", size(),
              " x output ", out.sizes());
  auto input = in.contiguous();
  impl_->wait(impl_->backend->_reduce_scatter_base(out, input, c10d::ReduceScatterOptions{}), "reduce_scatter");
}

void ProcessGroup::all_gather(at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(out.numel() == in.numel() * size(), "all_gather: output ", out.sizes(), " is not ", size(), " x input ",
              in.sizes());
  auto input = in.contiguous();
  impl_->wait(impl_->backend->_allgather_base(out, input, c10d::AllgatherOptions{}), "all_gather");
}

std::function<void()> ProcessGroup::start_all_gather(at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(out.numel() == in.numel() * size(), "all_gather: output ", out.sizes(), " is not ", size(), " x input ",
              in.sizes());
  auto input = in.contiguous();
  auto work = impl_->backend->_allgather_base(out, input, c10d::AllgatherOptions{});
  // The input stays alive until the work is done; the group outlives its callers' waits.
  return [impl = impl_.get(), work, input] { impl->wait(work, "all_gather (prefetch)"); };
}

void ProcessGroup::broadcast(at::Tensor& t, int root) {
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  impl_->wait(impl_->backend->broadcast(tensors, o), "broadcast");
}

void ProcessGroup::barrier() { impl_->wait(impl_->backend->barrier(c10d::BarrierOptions{}), "barrier"); }

double ProcessGroup::max(double local) {
  auto t = torch::tensor({local}, torch::kFloat64);
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  impl_->wait(impl_->backend->allreduce(tensors, o), "all_reduce(max)");
  return t.item<double>();
}

double ProcessGroup::sum(double local) {
  auto t = torch::tensor({local}, torch::kFloat64);
  all_reduce_sum(t);
  return t.item<double>();
}

}  // namespace troupe
