// Helpers shared by the records tests: a temporary directory, raw files,
// hex vectors. Header-only, torch-free (the tests run under the sanitizers).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "records/record_io.h"

namespace torch_stage::records::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its files.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") +
        "/torch_stage_records_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {
      throw std::runtime_error("mkdtemp failed");
    }
    path_ = buf.data();
  }
  ~TempDir() {
    std::string cmd = "rm -rf '" + path_ + "'";
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "could not remove %s\n", path_.c_str());
    }
  }
  std::string file(const std::string& name) const {
    return path_ + "/" + name;
  }
  const std::string& path() const {
    return path_;
  }

 private:
  std::string path_;
};

// The RecordError f() throws; a test failure (and a kIo error) if none.
template <typename F>
RecordError expect_error(F f) {
  try {
    f();
  } catch (const RecordError& e) {
    return e;
  }
  ADD_FAILURE() << "no RecordError thrown";
  return RecordError(RecordErrorKind::kIo, "");
}

inline std::string hex_decode(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

inline void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Writes `records` with RecordWriter.
inline void write_records(
    const std::string& path,
    const std::vector<std::string>& records,
    Compression compression = Compression::kNone) {
  RecordWriter writer(path, compression);
  for (const auto& r : records) {
    writer.write(r);
  }
  writer.close();
}

inline std::vector<std::string> read_all(
    const std::string& path,
    Compression compression = Compression::kNone) {
  RecordReader reader(path, compression);
  std::vector<std::string> out;
  std::string r;
  while (reader.read(&r)) {
    out.push_back(r);
  }
  return out;
}

} // namespace torch_stage::records::testing
