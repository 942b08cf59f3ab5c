// TCP transport. Registration keeps a table of regions by handle: TCP receives land straight
// into registered memory, so the table is what lets a receive be posted against a handle and an
// offset without any lookup by address on the data path.
#pragma once

#include <unordered_map>

#include "daemon/transport/transport.h"

namespace ringd {

class TcpTransport final : public Transport {
public:
    std::string_view name() const override { return "tcp"; }

    struct Region {
        std::byte *base = nullptr;
        size_t bytes = 0;
    };
    const Region *region(RegionHandle h) const;

protected:
    Result<RegionHandle> do_register(std::byte *base, size_t bytes) override;
    void do_deregister(RegionHandle h) override;

private:
    uint64_t next_id_ = 1;
    std::unordered_map<uint64_t, Region> regions_;
};

}  // namespace ringd
