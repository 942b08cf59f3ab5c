#include "daemon/transport/transport.h"

#include <spdlog/spdlog.h>

#include "daemon/config.h"
#include "daemon/transport/tcp/tcp_transport.h"
#ifdef RINGD_HAVE_IBVERBS
#include "daemon/transport/ibverbs/emulated_device.h"
#include "daemon/transport/ibverbs/ibverbs_transport.h"
#endif

namespace ringd {
Result<RegionHandle> Transport::register_region(std::byte *base, size_t bytes, int fd, uint64_t fd_offset) {
    auto h = do_register(base, bytes);
    if (!h) return h;
    h->fd = fd;
    h->fd_offset = fd >= 0 ? fd_offset : 0;
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

Result<std::unique_ptr<NetworkTransport>> make_transport(const Config &config) {
    if (config.transport == "tcp") {
        std::string cc = config.tcp.congestion == "system" ? "" : config.tcp.congestion;
        std::string note;
        if (cc == "auto") {
            // Not the kernel's default, which may pace (BBR): cubic, or reno where cubic may not be set.
            auto pick = TcpTransport::pick_congestion();
            cc = pick.name;
            if (!pick.why.empty()) {
                note = " (tcp.congestion: auto; cubic: not available to ringd here)";
                spdlog::info("tcp.congestion: auto: reno, the unpaced one this ringd may set ({})", pick.why);
            }
        }
        if (!cc.empty()) {
            if (auto s = TcpTransport::check_congestion(cc); !s) {
                if (config.tcp.congestion_set)
                    return make_error(s.error().code, "tcp.congestion: " + s.error().message + "; or set tcp.congestion: system");
                spdlog::warn("tcp.congestion (default {}): {}; the data streams keep the system's congestion control", cc,
                             s.error().message);
                cc.clear();
            }
        }
        // A fixed size above the kernel's cap is quietly cut to it (and turns autotuning off).
        if (config.tcp.socket_buffer)
            if (const auto why = TcpTransport::socket_buffer_cap(config.tcp.socket_buffer); !why.empty())
                spdlog::warn("tcp.socket_buffer ({} bytes): {}", config.tcp.socket_buffer, why);
        auto t = std::make_unique<TcpTransport>(std::move(cc), config.data_mac && !config.secret_file.empty(),
                                                config.tcp.socket_buffer, config.tcp.zero_copy,
                                                static_cast<uint32_t>(config.tcp.rail_timeout.count()));
        t->set_congestion_note(std::move(note));
        return std::unique_ptr<NetworkTransport>(std::move(t));
    }
#ifdef RINGD_HAVE_IBVERBS
    if (config.transport == "ibverbs") {
        const auto &c = config.ibverbs;
        IbverbsOptions o;
        o.provider = c.provider;
        o.device = c.device;
        o.port = static_cast<uint8_t>(c.port);
        o.gid_index = c.gid_index;
        o.mtu = c.mtu;
        o.qps_per_link = c.qps_per_link;
        o.timeout = static_cast<uint8_t>(c.timeout);
        o.retry_cnt = static_cast<uint8_t>(c.retry_cnt);
        o.rnr_retry = static_cast<uint8_t>(c.rnr_retry);
        const auto &api = c.provider == "emulated" ? verbs::emulated_verbs() : verbs::hardware_verbs();
        auto t = IbverbsTransport::create(api, o);
        if (!t) return t.error();
        return std::unique_ptr<NetworkTransport>(std::move(*t));
    }
#endif
    return make_error(-ENOTSUP, "transport: '" + config.transport +
                                    "' is not available in this ringd (built without libibverbs); use transport: tcp");
}

}  // namespace ringd
