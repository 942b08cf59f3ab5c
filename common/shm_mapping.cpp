#include "common/shm_mapping.h"

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/mapped_region.hpp>

#include <string>

namespace ringd {
namespace bip = boost::interprocess;

namespace {

// The MemoryMappable concept mapped_region needs: a mapping handle and a mode.
class FdMappable {
public:
    explicit FdMappable(int fd) : fd_(fd) {}
    bip::mapping_handle_t get_mapping_handle() const { return bip::ipcdetail::mapping_handle_from_file_handle(fd_); }
    bip::mode_t get_mode() const { return bip::read_write; }

private:
    int fd_;
};

}  // namespace

SharedMapping::SharedMapping() = default;
SharedMapping::~SharedMapping() = default;
SharedMapping::SharedMapping(SharedMapping &&) noexcept = default;
SharedMapping &SharedMapping::operator=(SharedMapping &&) noexcept = default;

Result<SharedMapping> SharedMapping::map(int fd, size_t bytes) {
    if (bytes == 0) return make_error(-EINVAL, "cannot map 0 bytes");
    try {
        SharedMapping m;
        m.region_ = std::make_unique<bip::mapped_region>(FdMappable(fd), bip::read_write, 0, bytes);
        return m;
    } catch (const bip::interprocess_exception &e) {
        const int native = e.get_native_error();
        return make_error(native > 0 ? -native : -ENOMEM, std::string("mmap of the slot failed: ") + e.what());
    } catch (const std::exception &e) {
        return make_error(-ENOMEM, std::string("mmap of the slot failed: ") + e.what());
    }
}

std::byte *SharedMapping::data() const {
    return region_ ? static_cast<std::byte *>(region_->get_address()) : nullptr;
}
size_t SharedMapping::size() const { return region_ ? region_->get_size() : 0; }

}  // namespace ringd
