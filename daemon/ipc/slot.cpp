#include "daemon/ipc/slot.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <cstring>
#include <new>

#include "common/fd_io.h"
#include "daemon/topology/topology.h"

namespace ringd {

// A sealed memfd of geo.map_bytes, mapped, with its header written (the queues are zero: a valid
// state for the atomic indices). `what` names it in errors.
Result<std::shared_ptr<Slot>> Slot::make(const std::string &name, const proto::SlotGeometry &geo, const char *what) {
    std::shared_ptr<Slot> s(new (std::nothrow) Slot());
    if (!s) return make_error(-ENOMEM, "out of memory");
    s->geo_ = geo;
    s->memfd_ = UniqueFd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!s->memfd_) return make_error(-errno, "memfd_create: " + errno_string(errno));
    if (::ftruncate(s->memfd_.get(), static_cast<off_t>(geo.map_bytes)) != 0)
        return make_error(-errno, std::string("ftruncate of the ") + what + " to " + std::to_string(geo.map_bytes) +
                                      " bytes: " + errno_string(errno));
    if (::fcntl(s->memfd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        return make_error(-errno, std::string("sealing the ") + what + " memfd: " + errno_string(errno));
    auto m = SharedMapping::map(s->memfd_.get(), geo.map_bytes);
    if (!m) return m.error();
    s->map_ = std::move(*m);
    auto &h = s->header();
    h.magic = proto::kSlotMagic;
    h.version = proto::kSlotVersion;
    h.features = proto::kSlotFeatureCudaReadySeq | proto::kSlotFeatureCollectives | proto::kSlotFeatureCudaCollectives |
                 proto::kSlotFeatureRootedCollectives | proto::kSlotFeatureCopyCounters |
                 proto::kSlotFeatureAllToAll | proto::kSlotFeatureWire | proto::kSlotFeatureCudaRooted |
                 proto::kSlotFeatureCudaAllToAll | proto::kSlotFeatureRefuse |
                 proto::kSlotFeatureCudaAllToAllSplits;
    h.sq_depth = geo.sq_depth;
    h.cq_depth = geo.cq_depth;
    h.data_offset = geo.data_offset;
    h.data_bytes = geo.data_bytes;
    return s;
}

Result<std::shared_ptr<Slot>> Slot::share(const std::string &name, std::shared_ptr<Slot> base) {
    if (!base) return make_error(-EINVAL, "no slot to share");
    if (base->base_) base = base->base_;  // the owner of the data, not another sharer
    // The queues' layout of a slot with the smallest data area; the data area itself is base's.
    auto geo = proto::slot_geometry(proto::kSlotDataAlign);
    if (!geo) return geo.error();
    geo->map_bytes = geo->data_offset;
    geo->data_bytes = 0;  // in this memfd (the Welcome says so); data_bytes() is base's
    auto s = make(name, *geo, "queues");
    if (!s) return s;
    (*s)->base_ = std::move(base);
    return s;
}

Result<std::shared_ptr<Slot>> Slot::create(const std::string &name, uint64_t data_bytes, Transport &transport, int node,
                                           std::string *placed) {
    auto geo = proto::slot_geometry(data_bytes);
    if (!geo) return geo.error();
    auto s = make(name, *geo, "slot");
    if (!s) return s;
    if (node >= 0) {
        // A memfd's policy is the file's: pages the trainer touches first go there too.
        std::string why;
        const bool ok = topology::prefer_node((*s)->map_.data() + geo->data_offset, geo->data_bytes, node, why);
        if (placed) *placed = ok ? why : "not placed: " + why;
    }
    // With its memfd: a transport may send the data region by reference (post_send_stable).
    auto reg = transport.register_region((*s)->data(), geo->data_bytes, (*s)->memfd_.get(), geo->data_offset);
    if (!reg) return reg.error();
    (*s)->registration_ = RegisteredRegion(&transport, *reg);
    return s;
}

}  // namespace ringd
