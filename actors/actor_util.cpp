#include "actors/actor_util.hpp"

#include <ATen/Parallel.h>

namespace troupe {

void name_failures(caf::scheduled_actor* self, std::string who) {
  self->set_exception_handler([who](caf::scheduled_actor*, std::exception_ptr& p) -> caf::error {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(p);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    return caf::make_error(caf::sec::runtime_error, who + ": " + what);
  });
}

void use_threads(int64_t n) {
  if (n <= 0) return;
  (void)at::get_num_threads();
  at::set_num_threads(static_cast<int>(n));
}

}  // namespace troupe
