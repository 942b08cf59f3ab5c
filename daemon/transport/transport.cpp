#include "daemon/transport/transport.h"

#include "daemon/config.h"
#include "daemon/transport/tcp/tcp_transport.h"

namespace ringd {

Result<RegionHandle> Transport::register_region(std::byte *base, size_t bytes) {
    auto h = do_register(base, bytes);
    if (!h) return h;
    ++stats_.registrations;
    ++stats_.live_regions;
    stats_.registered_bytes += bytes;
    return h;
}

void Transport::deregister_region(RegionHandle h) {
    if (h.id == 0) return;
    do_deregister(h);
    --stats_.live_regions;
    stats_.registered_bytes -= h.bytes;
}

Result<std::unique_ptr<Transport>> make_transport(const Config &config) {
    if (config.transport == "tcp") return std::unique_ptr<Transport>(std::make_unique<TcpTransport>());
    return make_error(-ENOTSUP, "transport: '" + config.transport +
                                    "' is not available in this ringd (the RDMA transport is not built yet); "
                                    "use transport: tcp");
}

}  // namespace ringd
