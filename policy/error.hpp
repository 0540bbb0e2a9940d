// The one error type thrown at IO and config boundaries (files, keys, requests).
// Tensor invariants use TORCH_CHECK instead; the command line turns either into one message.
#pragma once

#include <stdexcept>
#include <string>

namespace troupe {

// The message names the file or key first, then what is wrong, and where it helps, the fix:
//   "models/x.gguf: tensor 'blk.0.attn_q.weight' runs past the end of the file (truncated?)"
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace troupe
