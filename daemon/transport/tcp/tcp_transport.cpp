#include "daemon/transport/tcp/tcp_transport.h"

namespace ringd {

Result<RegionHandle> TcpTransport::do_register(std::byte *base, size_t bytes) {
    if (!base || bytes == 0) return make_error(-EINVAL, "cannot register an empty region");
    const uint64_t id = next_id_++;
    regions_.emplace(id, Region{base, bytes});
    return RegionHandle{id};
}

void TcpTransport::do_deregister(RegionHandle h) { regions_.erase(h.id); }

const TcpTransport::Region *TcpTransport::region(RegionHandle h) const {
    auto it = regions_.find(h.id);
    return it == regions_.end() ? nullptr : &it->second;
}

}  // namespace ringd
