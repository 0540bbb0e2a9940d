// Lays SFT records (sft_data.cpp) into padded or packed token tensors. The loss itself is in
// trainer.cpp.
#include "trainer/sft.hpp"

#include <algorithm>
#include <map>
#include <numeric>

#include <torch/torch.h>

#include "policy/error.hpp"

namespace troupe::sft {

std::vector<std::vector<int64_t>> pack(std::span<const Sequence> sequences, int64_t max_length) {
  if (max_length <= 0) throw Error("sft pack: max_length must be positive, got " + std::to_string(max_length));
  std::vector<int64_t> order(sequences.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return sequences[a].size() > sequences[b].size(); });
  std::vector<std::vector<int64_t>> rows;
  std::multimap<int64_t, size_t> by_space;  // room left -> row; the best fit is the least room that suffices
  for (int64_t i : order) {
    const int64_t len = sequences[i].size();
    if (len > max_length)
      throw Error("sft pack: a sequence of " + std::to_string(len) + " tokens" +
                  (sequences[i].line ? " (line " + std::to_string(sequences[i].line) + ")" : "") +
                  " is longer than a row of " + std::to_string(max_length));
    auto it = by_space.lower_bound(len);
    size_t row;
    int64_t room;
    if (it == by_space.end()) {
      row = rows.size();
      rows.emplace_back();
      room = max_length;
    } else {
      row = it->second;
      room = it->first;
      by_space.erase(it);
    }
    rows[row].push_back(i);
    by_space.emplace(room - len, row);
  }
  return rows;
}

Batch collate(std::span<const Sequence> sequences, std::span<const std::vector<int64_t>> rows) {
  const int64_t B = rows.size();
  int64_t T = 0;
  for (const auto& row : rows) {
    int64_t len = 0;
    for (int64_t i : row) len += sequences[i].size();
    T = std::max(T, len);
  }
  Batch b;
  b.ids = torch::zeros({B, T}, torch::kLong);
  b.positions = torch::zeros({B, T}, torch::kLong);
  b.token_mask = torch::zeros({B, T}, torch::kLong);
  b.loss_mask = torch::zeros({B, std::max<int64_t>(T - 1, 0)}, torch::kFloat32);
  auto ids = b.ids.accessor<int64_t, 2>();
  auto pos = b.positions.accessor<int64_t, 2>();
  auto tm = b.token_mask.accessor<int64_t, 2>();
  auto lm = b.loss_mask.accessor<float, 2>();
  for (int64_t r = 0; r < B; ++r) {
    int64_t t = 0;
    for (int64_t i : rows[r]) {
      const Sequence& s = sequences[i];
      TORCH_CHECK(s.loss_mask.size() == s.ids.size(), "sft collate: sequence ", i, " has ", s.ids.size(),
                  " ids but ", s.loss_mask.size(), " mask entries");
      for (int64_t k = 0; k < s.size(); ++k, ++t) {
        ids[r][t] = s.ids[k];
        pos[r][t] = k;
        tm[r][t] = 1;
        // The first token of a document is never a target: nothing before it is its context.
        if (k > 0 && s.loss_mask[k]) lm[r][t - 1] = 1;
      }
      ++b.sequences;
    }
  }
  b.tokens = static_cast<int64_t>(b.loss_mask.sum().item<double>());
  return b;
}

Batch collate(std::span<const Sequence> sequences) {
  std::vector<std::vector<int64_t>> rows(sequences.size());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = {static_cast<int64_t>(i)};
  return collate(sequences, rows);
}

std::vector<Batch> micro_batches(std::span<const Sequence> sequences, const BatchOptions& o) {
  if (sequences.empty()) throw Error("sft: a batch needs at least one sequence");
  std::vector<std::vector<int64_t>> rows;
  if (o.packing) {
    rows = pack(sequences, o.max_length);
  } else {
    for (size_t i = 0; i < sequences.size(); ++i) rows.push_back({static_cast<int64_t>(i)});
  }
  const int64_t R = rows.size();
  const int64_t per = o.micro_rows > 0 ? o.micro_rows : R;
  std::vector<Batch> out;
  for (int64_t s = 0; s < R; s += per)
    out.push_back(collate(sequences, std::span(rows).subspan(s, std::min(per, R - s))));
  return out;
}

}  // namespace troupe::sft
