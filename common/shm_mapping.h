// SharedMapping: a read-write MAP_SHARED mapping of a memfd, through Boost.Interprocess's
// mapped_region (the design's shared-memory layer). Boost maps its own shm/file objects; the
// FdMappable adapter lets it map an fd we already own (a memfd passed by SCM_RIGHTS).
#pragma once

#include <cstddef>
#include <memory>

#include "proto/result.h"

namespace boost::interprocess { class mapped_region; }

namespace ringd {

class SharedMapping {
public:
    SharedMapping();
    ~SharedMapping();
    SharedMapping(SharedMapping &&) noexcept;
    SharedMapping &operator=(SharedMapping &&) noexcept;

    // Maps `bytes` of `fd` from offset 0. The fd may be closed afterwards.
    static Result<SharedMapping> map(int fd, size_t bytes);

    std::byte *data() const;
    size_t size() const;

private:
    std::unique_ptr<boost::interprocess::mapped_region> region_;
};

}  // namespace ringd
