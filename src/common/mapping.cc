#include "common/mapping.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/units.h"

namespace netdam {

namespace {
// A failed system call: `msg` and errno's text.
Error fail(std::string msg) { return Error::transport(std::move(msg) + ": " + std::strerror(errno)); }

std::string shm_name(const std::string& name) { return name.starts_with('/') ? name : "/" + name; }
}  // namespace

Result<std::unique_ptr<Mapping>> Mapping::anonymous(uint64_t size) {
  if (size == 0) return Error::invalid("device memory size must be at least 1 byte");
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return fail("cannot allocate " + format_size(size) + " of device memory");
  return std::unique_ptr<Mapping>(new Mapping(p, size, -1, {}));
}

Result<std::unique_ptr<Mapping>> Mapping::create_shared(const std::string& name, uint64_t size) {
  const std::string path = shm_name(name);
  int fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot create shared memory /dev/shm" + path);
  // A live device holds the lock; a file left by a crashed one does not.
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    Error e = fail("shared memory /dev/shm" + path + " is in use by another device");
    close(fd);
    return e;
  }
  // Truncate to zero first so a stale object's contents never leak into the
  // new device: memory starts zeroed, like an anonymous mapping.
  if (ftruncate(fd, 0) != 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    Error e = fail("cannot size shared memory /dev/shm" + path + " to " + format_size(size));
    close(fd);
    shm_unlink(path.c_str());
    return e;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    Error e = fail("cannot map " + format_size(size) + " of shared memory /dev/shm" + path);
    close(fd);
    shm_unlink(path.c_str());
    return e;
  }
  return std::unique_ptr<Mapping>(new Mapping(p, size, fd, path));
}

Result<std::unique_ptr<Mapping>> Mapping::open_shared(const std::string& name) {
  const std::string path = shm_name(name);
  int fd = shm_open(path.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return fail("cannot open device shared memory /dev/shm" + path);
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    return Error::transport("device shared memory /dev/shm" + path + " is empty");
  }
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    Error e = fail("cannot map device shared memory /dev/shm" + path);
    close(fd);
    return e;
  }
  return std::unique_ptr<Mapping>(new Mapping(p, static_cast<size_t>(st.st_size), fd, {}));
}

Result<std::unique_ptr<Mapping>> Mapping::join_shared(const std::string& name, uint64_t size) {
  if (size == 0) return Error::invalid("shared memory size must be at least 1 byte");
  const std::string path = shm_name(name);
  int fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot open shared memory /dev/shm" + path);
  // Grow only: ftruncate to the same size keeps what the others stored;
  // every member asks for the same size, so one that comes later changes
  // nothing.
  struct stat st {};
  if (fstat(fd, &st) != 0 ||
      (static_cast<uint64_t>(st.st_size) < size && ftruncate(fd, static_cast<off_t>(size)) != 0)) {
    Error e = fail("cannot size shared memory /dev/shm" + path + " to " + format_size(size));
    close(fd);
    return e;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    Error e = fail("cannot map " + format_size(size) + " of shared memory /dev/shm" + path);
    close(fd);
    return e;
  }
  return std::unique_ptr<Mapping>(new Mapping(p, size, fd, {}));
}

void Mapping::unlink_shared(const std::string& name) { shm_unlink(shm_name(name).c_str()); }

Mapping::~Mapping() {
  munmap(addr_, size_);
  if (!unlink_name_.empty()) shm_unlink(unlink_name_.c_str());
  if (fd_ >= 0) close(fd_);
}

}  // namespace netdam
