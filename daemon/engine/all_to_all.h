// The block layout of one rank's all_to_all: how many elements it sends to each rank of the group
// and receives from each, and where each block lies in its input and output (elements, in rank
// order). `count` per block both ways, or the rank's split sizes (Submission::splits: the send
// counts, then the receive counts).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "proto/types.h"

namespace ringd {

class AllToAllLayout {
public:
    AllToAllLayout(const OpDesc &d, const std::shared_ptr<const std::vector<uint64_t>> &splits) : n_(d.ranks) {
        send_at_.resize(n_ + 1);
        recv_at_.resize(n_ + 1);
        for (uint32_t r = 0; r < n_; ++r) {
            const bool table = splits && splits->size() == 2 * size_t{n_};
            send_at_[r + 1] = send_at_[r] + (table ? (*splits)[r] : d.count);
            recv_at_[r + 1] = recv_at_[r] + (table ? (*splits)[n_ + r] : d.count);
        }
    }
    uint32_t ranks() const { return n_; }
    uint64_t send_count(uint32_t to) const { return send_at_[to + 1] - send_at_[to]; }
    uint64_t recv_count(uint32_t from) const { return recv_at_[from + 1] - recv_at_[from]; }
    uint64_t send_at(uint32_t to) const { return send_at_[to]; }
    uint64_t recv_at(uint32_t from) const { return recv_at_[from]; }

private:
    uint32_t n_;
    std::vector<uint64_t> send_at_, recv_at_;  // prefix sums (n + 1)
};

}  // namespace ringd
