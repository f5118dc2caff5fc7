// Durable file-system steps: what makes a checkpoint either whole or absent.
#pragma once

#include <string>
#include <string_view>

namespace lockstep::fs {

// mkdir -p (mode 0777 less the umask, which main() keeps at 022 or stricter); throws InputError naming the path on failure.
void make_dirs(const std::string& path);
// Writes `data` to `path` and fsyncs it (the file is created with mode 0644).
void write_file_synced(const std::string& path, std::string_view data);
// Writes to `path.tmp`, fsyncs, renames over `path`, fsyncs the directory.
void write_file_atomic(const std::string& path, std::string_view data);
// fsync of a directory, so that renames inside it are durable.
void sync_dir(const std::string& path);
// Reads a whole regular file; throws InputError naming the path when it cannot (missing,
// unreadable, a read error part-way, or not a regular file: a FIFO never blocks it).
std::string read_file(const std::string& path);
// Opens a regular file for reading (the same checks); the caller closes the descriptor.
int open_regular(const std::string& path);
bool exists(const std::string& path);
// rm -rf; errors are ignored (used for temporary and superseded folders only).
void remove_all(const std::string& path);

}  // namespace lockstep::fs
