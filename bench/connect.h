// Joining a group from the bench tools (ringd-bench, the chaos trainer): ringd_connect_opts with
// the group's hosts ("" = every host of the ring).
#pragma once

#include <cstddef>
#include <string>

#include "ringd/ringd.h"

namespace ringd::bench {

inline ringd_client *connect_group(const std::string &socket, const std::string &group, int local_rank, int local_size,
                                   size_t slot_bytes, const std::string &hosts, char *err, size_t err_len, int rank = 0,
                                   int ranks = 0) {
    ringd_options o{};
    o.struct_size = sizeof o;
    o.socket_path = socket.c_str();
    o.group = group.c_str();
    o.local_rank = local_rank;
    o.local_size = local_size;
    o.slot_bytes = slot_bytes;
    o.hosts = hosts.c_str();
    o.rank = rank;  // (reduce_scatter, allgather: this trainer's rank of `ranks`; 0 of 0: not said)
    o.ranks = ranks;
    return ringd_connect_opts(&o, err, err_len);
}

}  // namespace ringd::bench
