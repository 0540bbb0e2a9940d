// The NCCL process group, built only with CUDA (USE_C10D_NCCL comes from the wheel's torch_cuda
// target) and against the wheel's own nccl.h: NCCL's option structs change layout between
// versions, so the header must be the one libtorch_cuda.so was built with.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <nccl.h>

namespace troupe::detail {

int nccl_header_version() { return NCCL_VERSION_CODE; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace troupe::detail
