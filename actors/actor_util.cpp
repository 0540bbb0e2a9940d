#include "actors/actor_util.hpp"

#include <ATen/Parallel.h>

namespace troupe {

std::string describe(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  return "unknown exception";
}

void name_failures(caf::scheduled_actor* self, std::string who) {
  self->set_exception_handler([who](caf::scheduled_actor*, std::exception_ptr& p) -> caf::error {
    return caf::make_error(caf::sec::runtime_error, who + ": " + describe(p));
  });
}

void use_threads(int64_t n) {
  if (n <= 0) return;
  (void)at::get_num_threads();
  at::set_num_threads(static_cast<int>(n));
}

}  // namespace troupe
