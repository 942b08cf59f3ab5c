// Slot: one client's shared memory. A memfd sized, sealed (F_SEAL_SHRINK | F_SEAL_GROW |
// F_SEAL_SEAL) and mapped by the daemon, registered with the transport once, at creation.
// The client maps the same memfd; it cannot resize it, so the daemon never faults on it.
//
// Owned through shared_ptr: the control thread holds it while the client is connected and every
// op running on the progress thread holds it until the op ends, so a client that disappears
// mid-op never unmaps memory the engine is using. The queue indices in the header are written by
// the client and only ever read through the checks in ClientConn.
#pragma once

#include <memory>
#include <string>

#include "common/shm_mapping.h"
#include "common/unique_fd.h"
#include "daemon/transport/transport.h"
#include "proto/slot.h"

namespace ringd {

class Slot {
public:
    // `node` >= 0: the data area is placed on that NUMA node (a preferred-node policy on the
    // memfd, set before anything touches or registers it); `placed` says how that went.
    static Result<std::shared_ptr<Slot>> create(const std::string &name, uint64_t data_bytes, Transport &transport,
                                                int node = -1, std::string *placed = nullptr);
    // A slot with queues of its own (a new memfd: header and queues only, its geometry's data_bytes
    // 0) over the data area of `base` (another client's of the same process: HelloShared), which
    // it keeps alive.
    static Result<std::shared_ptr<Slot>> share(const std::string &name, std::shared_ptr<Slot> base);

    int memfd() const { return memfd_.get(); }
    const proto::SlotGeometry &geometry() const { return geo_; }
    proto::SlotHeader &header() const { return *reinterpret_cast<proto::SlotHeader *>(map_.data()); }
    const proto::SubmitDesc &sq_entry(uint64_t index) const {
        return reinterpret_cast<const proto::SubmitDesc *>(map_.data() + geo_.sq_offset)[index % geo_.sq_depth];
    }
    proto::CompletionDesc &cq_entry(uint64_t index) const {
        return reinterpret_cast<proto::CompletionDesc *>(map_.data() + geo_.cq_offset)[index % geo_.cq_depth];
    }
    std::byte *data() const { return base_ ? base_->data() : map_.data() + geo_.data_offset; }
    uint64_t data_bytes() const { return base_ ? base_->data_bytes() : geo_.data_bytes; }
    const RegionHandle &region() const { return base_ ? base_->region() : registration_.handle(); }
    // The slot whose data area this one uses (itself when it has its own).
    const Slot &data_owner() const { return base_ ? *base_ : *this; }
    // Where its data area was placed (create's `node`, -1: nowhere in particular), and why.
    int node() const { return data_owner().node_; }
    const std::string &placement() const { return data_owner().placement_; }
    void set_placement(int node, std::string why) {
        node_ = node;
        placement_ = std::move(why);
    }

private:
    Slot() = default;
    static Result<std::shared_ptr<Slot>> make(const std::string &name, const proto::SlotGeometry &geo, const char *what);
    // Creation order = declaration order; destruction undoes registration before unmapping.
    UniqueFd memfd_;
    proto::SlotGeometry geo_;
    SharedMapping map_;
    RegisteredRegion registration_;
    std::shared_ptr<Slot> base_;  // share(): the data area's slot (its own has none)
    int node_ = -1;
    std::string placement_;
};

}  // namespace ringd
