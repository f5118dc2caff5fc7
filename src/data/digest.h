// A file's content as one number: the CRC32 of every byte, streamed once and remembered in a
// per-user cache (keyed by path, size, mtime, ctime and inode), so a restart reads nothing and
// any rewrite is read again. Each entry carries an HMAC-SHA256 of what it says under this user's
// key (the cache folder's `key`, 32 random bytes, mode 0600): an entry edited to claim another
// CRC, or one from another user's cache, is not trusted and its file is read again. The job's
// fingerprint holds the data's and the initial weights'.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep {

struct ContentDigest {
  std::string crc32;       // "%08x" over every byte of the file
  int64_t bytes = 0;       // the file's size
  bool cached = false;     // from the cache: nothing was read
  bool distrusted = false; // the cache's entry for this file did not check out: read again
};

// Throws InputError naming `path` when it cannot be read. The cache lives in
// $XDG_CACHE_HOME/lockstep/digests (else ~/.cache/...; LOCKSTEP_DIGEST_CACHE overrides the
// folder, "off" turns it off); a cache it cannot write is only slower.
ContentDigest content_digest(const std::string& path);

}  // namespace lockstep
